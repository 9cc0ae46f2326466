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
#define X_PER_THREAD (BN * 32 / PTHREADS)  // 4-byte activation copies a producer thread issues per chunk

// The B tile in the MMA's logical k order (formats/nvfp4_mma.py): raw word w (inputs 2w, 2w+1 of the chunk)
// of token row n goes to logical 16-byte piece p = 2 t + j (t = (w >> 1) & 3, j = w & 1) at word q = w >> 3,
// inside the 128-byte swizzle (piece p of row n at (p ^ (n % 8)) * 16). A warp copying one row's 32 words
// writes 32 distinct banks.
QI int x_dst(int n, int w) {
  const int p = 2 * ((w >> 1) & 3) + (w & 1), q = w >> 3;
  return n * 128 + ((p ^ (n & 7)) << 4) + 4 * q;
}

// Producer thread pt's i-th activation copy of a chunk (i < X_PER_THREAD): token row and raw word. A warp's
// 32 lanes take the 32 words of one row (one 128-byte global read), warps interleave over rows.
QI int x_row(int pt, int i) { return (pt >> 5) + PW * i; }
QI int x_word(int pt) { return pt & 31; }

// Stage s's parts, as byte offsets from the ring's start.
QI int stage_b(int s) { return s * STAGE_BYTES; }
QI int stage_w(int s) { return s * STAGE_BYTES + XT_BYTES; }
QI int stage_s(int s) { return s * STAGE_BYTES + XT_BYTES + W_BYTES; }

// Weight copies (16 bytes each) of a chunk: WG * 4 row tiles x 32 lanes, i = 0 .. WG*128-1. Row tile rt0 + (i >> 5)
// of the CTA, lane i & 31; its source is u32x4 index (rt * KCH + gc) * 32 + lane (formats/nvfp4_mma.py).
QI long long w_src(int rt, int kch, int gc, int lane) { return ((long long)rt * kch + gc) * 32 + lane; }
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

// A fused-shrink launch hands out roles by ticket: the first `shrink_ctas` tickets shrink, then tile
// m = ticket - shrink_ctas runs (bx, by, z) = (m % gx, (m / gx) % gy, m / (gx * gy)).
QI void tile_of(int m, int gx, int gy, int* bx, int* by, int* z) {
  *bx = m % gx;
  *by = (m / gx) % gy;
  *z = m / (gx * gy);
}

// Accumulator i of consumer thread (warp wi of the consumer warpgroups, lane g*4+q): row and token in the CTA.
// wgmma's D layout: per warp, mma.sync's C layout for each 8 tokens: acc[4j + e] is row 16 wi + g + 8 (e >= 2),
// token 8 j + 2 q + (e & 1).
QI int acc_row(int wi, int lane, int i) { return 16 * wi + (lane >> 2) + 8 * ((i & 3) >= 2); }
QI int acc_tok(int lane, int i) { return 8 * (i >> 2) + 2 * (lane & 3) + (i & 1); }
