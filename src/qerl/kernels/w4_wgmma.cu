// NVFP4 x bf16 matmul for many tokens (M = 9..256) on sm_90a through wgmma. Compiled by NVRTC
// (kernels/w4_wgmma.py) after w4_common.cuh and w4_wgmma_index.cuh (the address arithmetic, which the CPU
// tests compile for the host), with WGMMA_STEP generated there for the token tile BN.
//
// The problem is transposed: weight rows are wgmma's M (64 per consumer warpgroup), tokens its N (BN per
// CTA, up to 256), inputs its K. Weights are the register-sourced operand A, in the same bytes the mma.sync
// kernel reads (formats/nvfp4_mma.py): warp w of a consumer warpgroup owns row tile w of the group's 64
// rows. That layout gives lane (g, q) inputs 16q .. 16q+15 of each 64-input chunk (one scale group), which is
// mma.sync's fragment order only under a permutation of k; here the consumers undo it instead: at k-step s
// lane (g, q) reads two words of lane (g, s) from shared memory and keeps the two registers of its half of
// the quad (w_read, pick_r0/pick_r1: ~6 integer ops a word), so activations stay in input order. They are
// operand B, from shared memory, K-major with the 128-byte swizzle, copied by 16-byte cp.async straight
// into the swizzled tile (x_dst): 8 copies a token row, no permute pass. (The first version moved the
// activations word by word into the permuted order instead: ~10 instructions per 4 bytes on one producer
// warp, which ncu showed was the whole kernel's limit.)
//
// Warp-specialised: PW producer warps (after the consumer warpgroups) only issue cp.async into a ring of ST
// stages {B tile, weights, scales}; each stage has a `full` mbarrier (the producers' cp.async completions
// arrive on it: cp.async.mbarrier.arrive.noinc) and an `empty` one (each consumer warpgroup arrives once its
// MMAs on the stage are done). Consumers wait for `full`, fence the generic-proxy writes for wgmma's async
// reads (the fence runs in threads with no cp.async of their own in flight, so it cannot drain the ring),
// decode the chunk into one of two A register sets, issue the chunk's 4 wgmmas back to back and keep one
// chunk's group in flight (wgmma.wait_group 1) while the next chunk decodes.
// Split K: CTAs along z keep partial sums apart; the last to arrive adds them in split order
// (deterministic: no float atomics, no reduce kernel). Epilogue: x 2^7/gs, + bias, + LoRA expand (an
// mma.sync per 16 of rank on the accumulator fragments: per warp, wgmma's D layout is mma.sync's C
// layout for each 8 tokens), round to bf16 once.
//
// LoRA shrink: given (xa, computed before the launch: w4_wgmma.matmul).
//
// Compile-time: WG (consumer warpgroups), PW (producer warps), BN (tokens a CTA, a multiple of 8, <= 256),
// ST (stages, >= 2), MINB (CTAs per SM the registers are capped for), HAS_BIAS, HAS_LORA, LORA_R (the rank).

#include "w4_wgmma_index.cuh"

#define THREADS (CTHREADS + PTHREADS)

__device__ __forceinline__ void cp_async16_z(u32 dst, const void* src, int bytes) {  // bytes 0: zero fill
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_init(u32 bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_cp_async(u32 bar) {  // when this thread's cp.asyncs so far land
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void consumers_sync() {  // the consumer warpgroups only (barrier 1)
  asm volatile("bar.sync 1, %0;" ::"n"(CTHREADS) : "memory");
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

WGMMA_STEP_DEFINITION

WGMMA_PICK_DEFINITION

// One chunk on a consumer warpgroup: wait for its stage, gather and decode the A registers of its 4 k-steps
// into `a`, 4 wgmmas, then free the previous chunk's stage (its group is the one wait_group 1 retires).
// Lane (g, q) at k-step s takes two words of lane (g, s) (w_read) and from each the two registers of its
// half of the quad (odd = q % 2: pick_r0 / pick_r1), scaled by lane (g, s)'s scales: the inputs of
// k-step s are then 16 s .. 16 s + 15 in their own order, as the B tile holds them.
__device__ __forceinline__ void consume(int c, u32 ring, u32 bars, int wi, int lane, float* acc, u32* a) {
  const int s = slot(c), g = lane >> 2, q = lane & 3;
  const u32 odd = q & 1;
  mbar_wait(bars + 8 * s, full_parity(c));
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // cp.async (generic proxy) -> wgmma (async proxy)
  u32 sc01, sc23;
  asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(sc01), "=r"(sc23) : "r"(ring + stage_s(s) + s_read(wi, g)));
  const u32 wbase = ring + stage_w(s);
#pragma unroll
  for (int t = 0; t < 4; t++) {
    u32 lo, hi, sl, sh;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(lo) : "r"(wbase + w_read(wi, g, t, q >> 1)));
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(hi) : "r"(wbase + w_read(wi, g, t, (q >> 1) + 2)));
    scales(((t < 2 ? sc01 : sc23) >> (16 * (t & 1))) & 0xFFFFu, sl, sh);
    a[4 * t + 0] = bmul2(pick_r0(lo, odd), sl);
    a[4 * t + 1] = bmul2(pick_r1(lo, odd), sh);
    a[4 * t + 2] = bmul2(pick_r0(hi, odd), sl);
    a[4 * t + 3] = bmul2(pick_r1(hi, odd), sh);
  }
  const u32 bt = ring + stage_b(s);
  wgmma_fence();
  wgmma_step(acc, a + 0, b_desc(bt));
  wgmma_step(acc, a + 4, b_desc(bt + 32));
  wgmma_step(acc, a + 8, b_desc(bt + 64));
  wgmma_step(acc, a + 12, b_desc(bt + 96));
  wgmma_commit();
  wgmma_wait<1>();
  if (c > 0 && (threadIdx.x & 127) == 0) mbar_arrive(bars + 8 * (ST + slot(c - 1)));
}

__device__ __forceinline__ void matmul_cta(
    const int bx, const int by, const int split, const int S, const int gx, const int gy,
    const u32x4* __restrict__ wq, const u16* __restrict__ wsc, const u16* __restrict__ x,
    u16* __restrict__ y, float* __restrict__ part, int* __restrict__ counters,
    const float* __restrict__ out_factor, const u16* __restrict__ bias, const u16* __restrict__ xa,
    const u16* __restrict__ lb, double lora_scaling, int rank, int seg1, int seg2,
    int M, int N, int K, int ldx, int ldy, int ldxa, int chunks_per_split) {
  extern __shared__ unsigned char smem[];
  __shared__ __align__(8) u64 bar_mem[2 * ST];  // full[ST], empty[ST]
  __shared__ int is_last;
  const u32 ring = (smem_addr(smem) + 1023) & ~1023u;  // the swizzle atoms are 1024-byte aligned
  const u32 bars = smem_addr(bar_mem);
  const int tid = threadIdx.x, lane = tid & 31, wi = tid >> 5;
  const int KCH = K >> 6, NT = N >> 4;
  const int rt0 = bx * WG * 4;  // the CTA's first row tile; consumer warp wi owns row tile rt0 + wi
  const int tok0 = by * BN;
  const int c_begin = chunk_begin(split, chunks_per_split);
  const int nch = chunk_count(split, chunks_per_split, KCH);
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < ST; s++) {
      mbar_init(bars + 8 * s, PTHREADS);    // full: every producer thread's cp.asyncs
      mbar_init(bars + 8 * (ST + s), WG);   // empty: one arrival per consumer warpgroup
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (tid >= CTHREADS) {  // producer warps
    const int pt = tid - CTHREADS, r0 = x_row(pt, 0);
    const int xb0 = x_base(pt, 0), xb1 = x_base(pt, 1);
    const int rows_left = M - tok0 - r0;  // copy i reads if i * X_ROWS_PASS < rows_left, else zero-fills
    const u16* xs = x + (u64)(tok0 + r0) * ldx + 8 * x_piece(pt);
    const u64 xstep = (u64)X_ROWS_PASS * ldx;
    for (int c = 0; c < nch; c++) {
      const int s = slot(c), gc = c_begin + c;
      if (c >= ST) mbar_wait(bars + 8 * (ST + s), empty_parity(c));
      const u32 b = ring + stage_b(s);
      const u16* xp = xs + gc * 64;
#pragma unroll 16
      for (int i = 0; i < X_PER_THREAD; i++)  // rows past M: zero fill, no read (src-size 0)
        cp_async16_z(b + x_off(i, xb0, xb1), xp + i * xstep, i * X_ROWS_PASS < rows_left ? 16 : 0);
#pragma unroll
      for (int i = pt; i < WG * 128; i += PTHREADS) {  // row tiles past N: zero fill
        const int rt = rt0 + (i >> 5);
        cp_async16_z(ring + stage_w(s) + w_slot(i) * 16, wq + w_src(rt < NT ? rt : 0, KCH, gc, i & 31), rt < NT ? 16 : 0);
      }
#pragma unroll
      for (int i = pt; i < WG * 16; i += PTHREADS) {
        const int rt = rt0 + (i >> 2);
        cp_async16_z(ring + stage_s(s) + i * 16, wsc + s_src(rt < NT ? rt : 0, KCH, gc, i & 3), rt < NT ? 16 : 0);
      }
      mbar_arrive_cp_async(bars + 8 * s);
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    return;  // the producers take no part in the epilogue (consumers_sync counts consumer threads only)
  }

  float acc[NACC];
#pragma unroll
  for (int i = 0; i < NACC; i++) acc[i] = 0.f;
  u32 a0[16], a1[16];  // two chunks' A registers: one being read by wgmma while the next decodes
  int c = 0;
  for (; c + 1 < nch; c += 2) {
    consume(c, ring, bars, wi, lane, acc, a0);
    consume(c + 1, ring, bars, wi, lane, acc, a1);
  }
  if (c < nch) consume(c, ring, bars, wi, lane, acc, a0);
  wgmma_wait<0>();

  const int ntile = by * gx + bx;
  if (S > 1) {
    // Partial sums [split][tile][thread][NACC], float4 per store; the last CTA of the tile adds them.
    float* mine = part + part_index(split, ntile, gx * gy, tid, 0);
#pragma unroll
    for (int i = 0; i < NACC; i += 4) st_f32x4((f32x4*)(mine + i), acc + i);
    __threadfence();
    consumers_sync();
    if (tid == 0) {
      const int ticket = atomicAdd(&counters[ntile], 1);
      is_last = ticket == S - 1;
      if (is_last) counters[ntile] = 0;  // ready for the next launch (graph replays too)
    }
    consumers_sync();
    if (!is_last) return;
    __threadfence();
#pragma unroll
    for (int i = 0; i < NACC; i++) acc[i] = 0.f;
    for (int s = 0; s < S; s++) {  // split order: the same bits every run
      const float* p = part + part_index(s, ntile, gx * gy, tid, 0);
#pragma unroll
      for (int i = 0; i < NACC; i += 4) {
        float v[4];
        ld_f32x4_l2((const f32x4*)(p + i), v);
        acc[i] += v[0]; acc[i + 1] += v[1]; acc[i + 2] += v[2]; acc[i + 3] += v[3];
      }
    }
  }

  // Epilogue. acc[4j + e]: row 16 wi + g (+8 for e >= 2) of the CTA, token 8j + 2q + (e & 1) (acc_row, acc_tok).
  const int rt = rt0 + wi, g = lane >> 2, q = lane & 3;
  if (rt >= NT) return;
  const int row0 = rt * 16 + g, row1 = row0 + 8;
  const float f = *out_factor;
  float b0 = 0.f, b1 = 0.f;
  if (HAS_BIAS) {
    b0 = bf16_to_f32(bias[row0]);
    b1 = bf16_to_f32(bias[row1]);
  }
  const int seg = (rt * 16 >= seg1) + (rt * 16 >= seg2);
  constexpr int LK = (LORA_R + 15) / 16;  // the expand's k-steps (rank compiled in: the loops unroll)
  u32 lbf[LK > 0 ? LK : 1][4];  // scaling * B[rows, :] as mma.sync A fragments, loaded once for every token
  if (HAS_LORA) {
#pragma unroll
    for (int kk = 0; kk < LK; kk++) {
      const int ka = 16 * kk + 2 * q, kb = ka + 8;
      lbf[kk][0] = ka < LORA_R ? ld_u32(lb + (u64)row0 * LORA_R + ka) : 0u;
      lbf[kk][1] = ka < LORA_R ? ld_u32(lb + (u64)row1 * LORA_R + ka) : 0u;
      lbf[kk][2] = kb < LORA_R ? ld_u32(lb + (u64)row0 * LORA_R + kb) : 0u;
      lbf[kk][3] = kb < LORA_R ? ld_u32(lb + (u64)row1 * LORA_R + kb) : 0u;
    }
  }
#pragma unroll
  for (int j = 0; j < BN / 8; j++) {
    const int t0 = tok0 + 8 * j + 2 * q;
    if (tok0 + 8 * j >= M) continue;
    float o[4] = {acc[4 * j] * f + b0, acc[4 * j + 1] * f + b0, acc[4 * j + 2] * f + b1, acc[4 * j + 3] * f + b1};
    if (HAS_LORA) {  // scaling * B[rows] @ xa[tokens, segment]^T: B's rows are mma.sync's A here
      const u16* xr = xa + (u64)imin(tok0 + 8 * j + g, M - 1) * ldxa + seg * LORA_R;
      float l[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int kk = 0; kk < LK; kk++) {
        const int ka = 16 * kk + 2 * q, kb = ka + 8;
        const u32 x0 = ka < LORA_R ? ld_u32(xr + ka) : 0u;
        const u32 x1 = kb < LORA_R ? ld_u32(xr + kb) : 0u;
        mma_bf16(l, lbf[kk][0], lbf[kk][1], lbf[kk][2], lbf[kk][3], x0, x1);
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

extern "C" __global__ void __launch_bounds__(THREADS, MINB) w4_wgmma_matmul(
    const u32x4* __restrict__ wq, const u16* __restrict__ wsc, const u16* __restrict__ x,
    u16* __restrict__ y, float* __restrict__ part, int* __restrict__ counters,
    const float* __restrict__ out_factor, const u16* __restrict__ bias, const u16* __restrict__ xa,
    const u16* __restrict__ lb, double lora_scaling, int rank, int seg1, int seg2,
    int M, int N, int K, int ldx, int ldy, int ldxa, int chunks_per_split, int gx, int gy, int splits) {
  matmul_cta(blockIdx.x, blockIdx.y, blockIdx.z, splits, gx, gy, wq, wsc, x, y, part, counters, out_factor, bias, xa,
             lb, lora_scaling, rank, seg1, seg2, M, N, K, ldx, ldy, ldxa, chunks_per_split);
}
