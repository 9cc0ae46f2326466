// NVFP4 x bf16 matmul for many tokens (M = 9..256) on sm_90a through wgmma. Compiled by NVRTC
// (kernels/w4_wgmma.py) after w4_common.cuh, with WGMMA_STEP generated there for the token tile BN.
//
// The problem is transposed: weight rows are wgmma's M (64 per consumer warpgroup), tokens its N
// (BN per CTA, up to 256), inputs its K. Weights are the register-sourced operand A, in the same bytes
// the mma.sync kernel reads (formats/nvfp4_mma.py): warp w of a warpgroup owns row tile w of the
// group's 64 rows, and each lane's 16 bytes of a 64-input chunk decode into its A registers of the
// chunk's 4 k-steps, once per CTA (mma.sync re-decodes them for every 8 tokens' worth of MMAs).
// Activations are operand B, from shared memory, K-major with the 128-byte swizzle. They are staged
// there in the MMA's logical k order: the layout permutes inputs inside each 64-chunk so that a lane's
// 16 weights share one scale, and the same permutation of the activations (a 4 x 4 transpose of
// 32-bit pairs, `permute_x`) leaves the dot product unchanged.
//
// Pipeline: ST chunks in flight through cp.async (raw activations, weights, scales). Per chunk the CTA
// permutes the raw activations into one of two swizzled B tiles, then each warpgroup decodes k-step
// t+1 while wgmma t runs (A registers double-buffered; wgmma.wait_group 1).
// Split K: CTAs along z keep partial sums apart; the last to arrive adds them in split order
// (deterministic: no float atomics, no reduce kernel). Epilogue: x 2^7/gs, + bias, + LoRA expand (an
// mma.sync per 16 of rank on the accumulator fragments: per warp, wgmma's D layout is mma.sync's C
// layout for each 8 tokens), round to bf16 once.
//
// LoRA shrink: given (xa), or inside the launch (FUSE_SHRINK: extra CTAs compute xa first, by ticket).
//
// Compile-time: WG (consumer warpgroups, 64 rows each), BN (tokens per CTA: a multiple of 8, <= 256),
// ST (chunks in flight, >= 2), HAS_BIAS, HAS_LORA, FUSE_SHRINK; MT = BN / 8 and WARPS = 4 WG for the
// shared shrink_cta.

#define THREADS (WG * 128)
#define XRAW_ROW 144  // bytes per raw activation row: 128 + 16 of padding, so the permute's reads do not conflict
#define XRAW_BYTES (BN * XRAW_ROW)
#define W_BYTES (WG * 4 * 512)  // 4 row tiles a warpgroup x 32 lanes x 16 bytes
#define S_BYTES (WG * 4 * 64)   // 4 row tiles a warpgroup x 32 lanes x 2 scale bytes
#define STAGE_BYTES (XRAW_BYTES + W_BYTES + S_BYTES)
#define XT_BYTES (BN * 128)  // one swizzled B tile (a multiple of the 1024-byte swizzle atom)
#define NACC (BN / 2)        // fp32 accumulators a thread: m64 x BN over 128 threads

__device__ __forceinline__ void cp_async16(u32 dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// The sm_90 shared-memory matrix descriptor: start address, leading byte offset (unused by swizzled
// K-major layouts: 1), stride byte offset (8 rows x 128 B between 8-token groups), 128-byte swizzle.
__device__ __forceinline__ u64 b_desc(u32 addr) {
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}
// Where logical 16-byte piece p (8 k values) of token row n sits in a swizzled B tile.
__device__ __forceinline__ u32 swz(int n, int p) { return n * 128 + ((p ^ (n & 7)) << 4); }

WGMMA_STEP_DEFINITION

__device__ __forceinline__ void matmul_cta(
    const int bx, const int by, const int split, const int S, const int gx, const int gy,
    const u32x4* __restrict__ wq, const u16* __restrict__ wsc, const u16* __restrict__ x,
    u16* __restrict__ y, float* __restrict__ part, int* __restrict__ counters,
    const float* __restrict__ out_factor, const u16* __restrict__ bias, const u16* __restrict__ xa,
    const u16* __restrict__ lb, double lora_scaling, int rank, int seg1, int seg2,
    int M, int N, int K, int ldx, int ldy, int ldxa, int chunks_per_split, const int* xa_ready, int shrink_ctas) {
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* xt = smem;                     // 2 B tiles, 1024-aligned
  unsigned char* stages = smem + 2 * XT_BYTES;  // ST x {raw x, weights, scales}
  const int tid = threadIdx.x, lane = tid & 31, wi = tid >> 5, g = lane >> 2, q = lane & 3;
  const int KCH = K >> 6, NT = N >> 4;
  const int rt0 = bx * WG * 4;  // the CTA's first row tile; warp wi owns row tile rt0 + wi
  const int tok0 = by * BN;
  const int c_begin = split * chunks_per_split;
  const int nch = imin(c_begin + chunks_per_split, KCH) - c_begin;

  // Chunk c of this split into ring slot c % ST; past the end it re-reads the last chunk, so every
  // thread commits one group per chunk and the wait counts stay uniform.
  auto load_chunk = [&](int c) {
    const int gc = c_begin + imin(c, nch - 1);
    unsigned char* st = stages + (c % ST) * STAGE_BYTES;
    for (int i = tid; i < BN * 8; i += THREADS) {  // tokens past M re-read row M-1 (never stored)
      const int n = i >> 3, p = i & 7;
      cp_async16(smem_addr(st + n * XRAW_ROW + p * 16), x + (u64)imin(tok0 + n, M - 1) * ldx + gc * 64 + p * 8);
    }
    for (int i = tid; i < WG * 4 * 32; i += THREADS) {  // row tiles past N re-read tile NT-1 (never stored)
      const int rt = imin(rt0 + (i >> 5), NT - 1);
      cp_async16(smem_addr(st + XRAW_BYTES + i * 16), wq + ((u64)rt * KCH + gc) * 32 + (i & 31));
    }
    for (int i = tid; i < WG * 4 * 4; i += THREADS) {
      const int rt = imin(rt0 + (i >> 2), NT - 1);
      cp_async16(smem_addr(st + XRAW_BYTES + W_BYTES + i * 16), wsc + ((u64)rt * KCH + gc) * 32 + (i & 3) * 8);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };
  // Raw row n, input block j = 2q + s (inputs 8j .. 8j+7), 32-bit word w holds inputs 16q + 8s + 2w + {0,1},
  // which the MMA reads at logical piece 4s + w, pair q (k-step t = 2s + w/2, k 2q + 8(w%2) + {0,1}).
  auto permute_x = [&](int c, unsigned char* dst) {
    const unsigned char* raw = stages + (c % ST) * STAGE_BYTES;
    for (int i = tid; i < BN * 2; i += THREADS) {
      const int n = i >> 1, s = i & 1;
      u32x4 b[4];
#pragma unroll
      for (int qq = 0; qq < 4; qq++) b[qq] = *(const u32x4*)(raw + n * XRAW_ROW + (2 * qq + s) * 16);
      *(u32x4*)(dst + swz(n, 4 * s + 0)) = u32x4{b[0].x, b[1].x, b[2].x, b[3].x};
      *(u32x4*)(dst + swz(n, 4 * s + 1)) = u32x4{b[0].y, b[1].y, b[2].y, b[3].y};
      *(u32x4*)(dst + swz(n, 4 * s + 2)) = u32x4{b[0].z, b[1].z, b[2].z, b[3].z};
      *(u32x4*)(dst + swz(n, 4 * s + 3)) = u32x4{b[0].w, b[1].w, b[2].w, b[3].w};
    }
  };

  float acc[NACC];
#pragma unroll
  for (int i = 0; i < NACC; i++) acc[i] = 0.f;

#pragma unroll
  for (int s = 0; s < ST - 1; s++) load_chunk(s);
  u32 a[2][4];
  for (int c = 0; c < nch; c++) {
    asm volatile("cp.async.wait_group %0;" ::"n"(ST - 2) : "memory");
    __syncthreads();  // chunk c is in; every thread is done with chunk c-1's slot and with B tile c&1's readers (c-2)
    load_chunk(c + ST - 1);
    unsigned char* bt = xt + (c & 1) * XT_BYTES;
    permute_x(c, bt);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic-proxy stores -> wgmma's async reads
    __syncthreads();
    const unsigned char* st = stages + (c % ST) * STAGE_BYTES;
    const u32x4 w = *(const u32x4*)(st + XRAW_BYTES + (wi * 32 + lane) * 16);
    u32 sl, sh;
    scales(*(const u16*)(st + XRAW_BYTES + W_BYTES + (wi * 32 + lane) * 2), sl, sh);
    const u32 bt_addr = smem_addr(bt);
#pragma unroll
    for (int t = 0; t < 4; t++) {  // buffer t & 1: wgmma t-2 read it, and wait_group 1 after t-1 retired it
      const u32 v = t == 0 ? w.x : t == 1 ? w.y : t == 2 ? w.z : w.w;
      decode_word(v, sl, sh, a[t & 1][0], a[t & 1][1], a[t & 1][2], a[t & 1][3]);
      wgmma_fence();
      wgmma_step(acc, a[t & 1], b_desc(bt_addr + 32 * t));
      wgmma_commit();
      wgmma_wait<1>();
    }
  }
  wgmma_wait<0>();
  asm volatile("cp.async.wait_group 0;" ::: "memory");

  const int ntile = by * gx + bx;
  if (S > 1) {
    // Partial sums [split][tile][thread][NACC], float4 per store; the last CTA of the tile adds them.
    float* mine = part + (((u64)split * gx * gy + ntile) * THREADS + tid) * NACC;
#pragma unroll
    for (int i = 0; i < NACC; i += 4) st_f32x4((f32x4*)(mine + i), acc + i);
    __threadfence();
    __syncthreads();
    __shared__ int is_last;
    if (tid == 0) {
      const int ticket = atomicAdd(&counters[ntile], 1);
      is_last = ticket == S - 1;
      if (is_last) counters[ntile] = 0;  // ready for the next launch (graph replays too)
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
#pragma unroll
    for (int i = 0; i < NACC; i++) acc[i] = 0.f;
    for (int s = 0; s < S; s++) {  // split order: the same bits every run
      const float* p = part + (((u64)s * gx * gy + ntile) * THREADS + tid) * NACC;
#pragma unroll
      for (int i = 0; i < NACC; i += 4) {
        float v[4];
        ld_f32x4_l2((const f32x4*)(p + i), v);
        acc[i] += v[0]; acc[i + 1] += v[1]; acc[i + 2] += v[2]; acc[i + 3] += v[3];
      }
    }
  }

  // Epilogue. acc[4j + e]: row 16 wi + g (+8 for e >= 2) of the CTA, token 8j + 2q + (e & 1).
  if (FUSE_SHRINK) {  // the shrink CTAs took the first tickets, so they run and never wait: no deadlock
    if (tid == 0)
      while (ld_acquire(xa_ready) < shrink_ctas) {
      }
    __syncthreads();
  }
  const int rt = rt0 + wi;
  if (rt >= NT) return;
  const int row0 = rt * 16 + g, row1 = row0 + 8;
  const float f = *out_factor;
  float b0 = 0.f, b1 = 0.f;
  if (HAS_BIAS) {
    b0 = bf16_to_f32(bias[row0]);
    b1 = bf16_to_f32(bias[row1]);
  }
  const int seg = (rt * 16 >= seg1) + (rt * 16 >= seg2);
#pragma unroll
  for (int j = 0; j < BN / 8; j++) {
    const int t0 = tok0 + 8 * j + 2 * q;
    if (tok0 + 8 * j >= M) break;
    float o[4] = {acc[4 * j] * f + b0, acc[4 * j + 1] * f + b0, acc[4 * j + 2] * f + b1, acc[4 * j + 3] * f + b1};
    if (HAS_LORA) {  // scaling * B[rows] @ xa[tokens, segment]^T: B's rows are mma.sync's A here
      const u16* xr = xa + (u64)imin(tok0 + 8 * j + g, M - 1) * ldxa + seg * rank;
      float l[4] = {0.f, 0.f, 0.f, 0.f};
      for (int k0 = 0; k0 < rank; k0 += 16) {
        const int ka = k0 + 2 * q, kb = ka + 8;
        const u32 a0 = ka < rank ? ld_u32(lb + (u64)row0 * rank + ka) : 0u;
        const u32 a1 = ka < rank ? ld_u32(lb + (u64)row1 * rank + ka) : 0u;
        const u32 a2 = kb < rank ? ld_u32(lb + (u64)row0 * rank + kb) : 0u;
        const u32 a3 = kb < rank ? ld_u32(lb + (u64)row1 * rank + kb) : 0u;
        // xa written by this launch's shrink CTAs: read from L2, not a stale L1 line
        const u32 x0 = ka < rank ? (FUSE_SHRINK ? ld_u32_l2(xr + ka) : ld_u32(xr + ka)) : 0u;
        const u32 x1 = kb < rank ? (FUSE_SHRINK ? ld_u32_l2(xr + kb) : ld_u32(xr + kb)) : 0u;
        mma_bf16(l, a0, a1, a2, a3, x0, x1);
      }
      const float sc = (float)lora_scaling;
      o[0] += l[0] * sc; o[1] += l[1] * sc; o[2] += l[2] * sc; o[3] += l[3] * sc;
    }
    if (t0 < M) {
      y[(u64)t0 * ldy + row0] = f32_to_bf16(o[0]);
      y[(u64)t0 * ldy + row1] = f32_to_bf16(o[2]);
    }
    if (t0 + 1 < M) {
      y[(u64)(t0 + 1) * ldy + row0] = f32_to_bf16(o[1]);
      y[(u64)(t0 + 1) * ldy + row1] = f32_to_bf16(o[3]);
    }
  }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) w4_wgmma_matmul(
    const u32x4* __restrict__ wq, const u16* __restrict__ wsc, const u16* __restrict__ x,
    u16* __restrict__ y, float* __restrict__ part, int* __restrict__ counters,
    const float* __restrict__ out_factor, const u16* __restrict__ bias, u16* __restrict__ xa,
    const u16* __restrict__ lb, double lora_scaling, int rank, int seg1, int seg2,
    int M, int N, int K, int ldx, int ldy, int ldxa, int chunks_per_split,
    const u16* __restrict__ lora_a, int shrink_ctas, int gx, int gy, int splits, int sync_base) {
  if (!FUSE_SHRINK) {
    matmul_cta(blockIdx.x, blockIdx.y, blockIdx.z, splits, gx, gy, wq, wsc, x, y, part, counters, out_factor, bias, xa,
               lb, lora_scaling, rank, seg1, seg2, M, N, K, ldx, ldy, ldxa, chunks_per_split, counters, 0);
    return;
  }
  // Roles by ticket, in the order CTAs start: tickets 0..shrink_ctas-1 compute xa = x @ lora_a^T (16 rows
  // of lora_a each), the rest the matmul tiles, whose epilogues wait for xa. A CTA that waits started
  // after every shrink CTA, which therefore runs: no deadlock at any occupancy.
  // sync: [ticket, xa ready, finished] counters at sync_base; the last CTA to finish resets them.
  int* sync = counters + sync_base;
  __shared__ int role;
  if (threadIdx.x == 0) role = atomicAdd(&sync[0], 1);
  __syncthreads();
  const int t = role;
  if (t < shrink_ctas) {
    shrink_cta(t, x, lora_a, xa, ldxa, M, K, ldx);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) atomicAdd(&sync[1], 1);
  } else {
    const int m = t - shrink_ctas;
    matmul_cta(m % gx, (m / gx) % gy, m / (gx * gy), splits, gx, gy, wq, wsc, x, y, part, counters, out_factor, bias,
               xa, lb, lora_scaling, rank, seg1, seg2, M, N, K, ldx, ldy, ldxa, chunks_per_split, &sync[1], shrink_ctas);
  }
  __syncthreads();
  if (threadIdx.x == 0 && atomicAdd(&sync[2], 1) == gridDim.x - 1) {
    sync[0] = 0;  // the last CTA to finish: every other one is done with the counters
    sync[1] = 0;
    sync[2] = 0;
  }
}
