// The wgmma kernel's address arithmetic (w4_wgmma.cu), apart from its instructions so that the CPU tests
// compile this very file for the host (tests/test_w4_wgmma_index.py, through ctypes) and check every map
// against an independent definition: an index bug here fails CI, not a device call.
//
// Needs WG, BN, ST (see w4_wgmma.cu) defined before it; plain C++ otherwise (no CUDA types or headers).

#ifdef __CUDACC__
#define QI __host__ __device__ __forceinline__
#else
#define QI inline
#endif

#define CTHREADS (WG * 128)             // consumer threads: WG warpgroups, 64 weight rows each
#define PTHREADS (PW * 32)              // the producer warps (cp.async only), after the consumers
#define XT_BYTES (BN * 128)             // one B tile: BN token rows of 64 inputs, 128-byte swizzle (1024-aligned)
#define W_BYTES (WG * 4 * 512)          // a chunk's weights: 4 row tiles a warpgroup x 32 lanes x 16 bytes
#define S_BYTES (WG * 4 * 64)           // a chunk's scales: 4 row tiles a warpgroup x 32 lanes x 2 bytes
#define STAGE_BYTES ((XT_BYTES + W_BYTES + S_BYTES + 1023) / 1024 * 1024)  // each B tile 1024-aligned
#define NACC (BN / 2)                   // fp32 accumulators a consumer thread: m64 x BN over 128 threads
#define X_PER_THREAD (BN * 8 / PTHREADS)  // 16-byte activation copies a producer thread issues per chunk
#define X_ROWS_PASS (PTHREADS / 8)        // token rows the producers copy per pass (8 lanes a 128-byte row)

// The B tile: token row n's 16-byte piece p (inputs 8p .. 8p+7 of the chunk, in input order) at the 128-byte
// swizzle, K-major, as wgmma's descriptor reads it (b_desc). Inputs stay in their order: the weights' MMA
// permutation is undone on the consumer side instead (w_read), so a copy moves 16 contiguous bytes.
QI int x_dst(int n, int p) { return n * 128 + ((p ^ (n & 7)) << 4); }

// Producer thread pt's i-th activation copy of a chunk (i < X_PER_THREAD): token row and piece. 8 lanes take
// one row's 8 pieces (one 128-byte global read), a warp 4 rows, the producer warps X_ROWS_PASS rows a pass.
QI int x_row(int pt, int i) { return i * X_ROWS_PASS + (pt >> 3); }
QI int x_piece(int pt) { return pt & 7; }
// x_dst(x_row(pt, i), x_piece(pt)) as the producer computes it: rows step by X_ROWS_PASS (a multiple of 4), so
// the swizzle term repeats every two copies: two per-thread bases, then a constant stride per copy.
QI int x_base(int pt, int parity) { return x_dst(x_row(pt, parity), x_piece(pt)) - parity * X_ROWS_PASS * 128; }
QI int x_off(int i, int base0, int base1) { return ((i & 1) ? base1 : base0) + i * X_ROWS_PASS * 128; }

// Stage s's parts, as byte offsets from the ring's start.
QI int stage_b(int s) { return s * STAGE_BYTES; }
QI int stage_w(int s) { return s * STAGE_BYTES + XT_BYTES; }
QI int stage_s(int s) { return s * STAGE_BYTES + XT_BYTES + W_BYTES; }

// Weight copies (16 bytes each) of a chunk: WG * 4 row tiles x 32 lanes, i = 0 .. WG*128-1. Row tile rt0 + (i >> 5)
// of the CTA, lane i & 31; its source is u32x4 index (rt * KCH + gc) * 32 + lane (formats/nvfp4_mma.py).
QI long long w_src(int rt, int kch, int gc, int lane) { return ((long long)rt * kch + gc) * 32 + lane; }
// In shared memory lane l = 4 g + q's 16 bytes sit at slot 8 q + g of their row tile: the consumers read
// q-major (w_read), and this order puts a warp's 16 words of a k-step in 16 distinct banks.
QI int w_slot(int i) { return (i & ~31) | ((i & 3) << 3) | ((i >> 2) & 7); }
// Consumer lane (g, q) of warp wi at k-step s: inputs 16 s + 2 q (+1) and + 8 (+9) of rows g, g + 8 are in
// lane (g, s)'s words t = q / 2 and q / 2 + 2 (formats/nvfp4_mma.py: lane (g, q') word t holds inputs
// 16 q' + 4 t + 0..3), in its registers 2 (q % 2) (row g) and 2 (q % 2) + 1 (row g + 8): byte offset of word t.
QI int w_read(int wi, int g, int s, int t) { return (wi * 32 + 8 * s + g) * 16 + 4 * t; }
// The scales of lanes (g, 0..3) (group s of rows g, g + 8 for k-step s), 8 contiguous bytes.
QI int s_read(int wi, int g) { return (wi * 32 + 4 * g) * 2; }

// Scale copies (16 bytes = 8 lanes' 2 bytes): WG * 4 row tiles x 4, i = 0 .. WG*16-1; source u16 index.
QI long long s_src(int rt, int kch, int gc, int part) { return ((long long)rt * kch + gc) * 32 + part * 8; }

// Ring bookkeeping: chunk c lives in slot c % ST; the mbarrier phase parity of its k-th use is k & 1.
QI int slot(int c) { return c % ST; }
QI int full_parity(int c) { return (c / ST) & 1; }
QI int empty_parity(int c) { return ((c / ST) - 1) & 1; }  // the producer's wait before refilling (c >= ST)

// Split K: split z of a launch takes chunks [z * cps, min((z + 1) * cps, kch)).
QI int chunk_begin(int z, int cps) { return z * cps; }
QI int chunk_count(int z, int cps, int kch) {
  const int e = (z + 1) * cps < kch ? (z + 1) * cps : kch;
  return e - z * cps > 0 ? e - z * cps : 0;
}

// Partial sums [split][tile][consumer thread][NACC] as float4 stores.
QI long long part_index(int z, int tile, int ntiles, int ct, int i) {
  return (((long long)z * ntiles + tile) * CTHREADS + ct) * NACC + i;
}

// Accumulator i of consumer thread (warp wi of the consumer warpgroups, lane g*4+q): row and token in the CTA.
// wgmma's D layout: per warp, mma.sync's C layout for each 8 tokens: acc[4j + e] is row 16 wi + g + 8 (e >= 2),
// token 8 j + 2 q + (e & 1).
QI int acc_row(int wi, int lane, int i) { return 16 * wi + (lane >> 2) + 8 * ((i & 3) >= 2); }
QI int acc_tok(int lane, int i) { return 8 * (i >> 2) + 2 * (lane & 3) + (i & 1); }
