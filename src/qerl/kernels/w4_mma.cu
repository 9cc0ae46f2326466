// NVFP4 x bf16 matmul for few tokens on sm_80+ through mma.sync, and the dequantize kernel of the
// same layout for large M. Compiled at run time by NVRTC (kernels/w4_mma.py) after w4_common.cuh.
//
// Weights come in the fragment order of formats/nvfp4_mma.py: per 16-row tile and 64-input chunk,
// lane l = 4g + q reads 16 bytes that decode straight into its four A registers of four k-steps
// (rows g, g+8; inputs 16q..16q+15 of the chunk) and 2 scale bytes. Tokens are the MMA's n (8 per
// tile, MT tiles); features are its m. Each warp owns RT row tiles over a range of chunks; a grid
// of row blocks x K splits fills the GPU, and the last CTA of a row block to finish adds the splits'
// partial sums in split order (deterministic: no float atomics, no reduce kernel), then runs the
// epilogue: x 2^7/gs, + bias, + LoRA expand (one more MMA over the rank), round to bf16 once.
//
// Compile-time: MT (8-token tiles), RT (row tiles per warp), WARPS (per CTA), ST (chunks in flight
// per warp), XSM (stage activations in shared memory, XST chunks deep), DUAL (two accumulator sets),
// HAS_BIAS, HAS_LORA, FUSE_SHRINK (the LoRA shrink x @ A^T computed by extra CTAs of the same launch).

__device__ __forceinline__ void matmul_cta(
    const int bx, const int split, const int S,
    const u32x4* __restrict__ wq, const u16* __restrict__ wsc, const u16* __restrict__ x,
    u16* __restrict__ y, f32x4* __restrict__ part, int* __restrict__ counters,
    const float* __restrict__ out_factor, const u16* __restrict__ bias, const u16* __restrict__ xa,
    const u16* __restrict__ lb, double lora_scaling, int rank, int seg1, int seg2,
    int M, int N, int K, int ldx, int ldy, int ldxa, int chunks_per_split, const int* xa_ready, int shrink_ctas) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, q = lane & 3;
  const int KCH = K >> 6, NT = N >> 4;
  const int c_begin = split * chunks_per_split;
  const int c_end = imin(c_begin + chunks_per_split, KCH);
  const int nch = c_end - c_begin;
  const int rt0 = (bx * WARPS + warp) * RT;

  float acc[RT][MT][4];
#pragma unroll
  for (int r = 0; r < RT; r++)
#pragma unroll
    for (int j = 0; j < MT; j++) acc[r][j][0] = acc[r][j][1] = acc[r][j][2] = acc[r][j][3] = 0.f;

  // Row tiles past N (the last block's spare warps) read tile NT-1 and store nothing.
  const u32x4* wp[RT];
  const u16* sp[RT];
#pragma unroll
  for (int r = 0; r < RT; r++) {
    const int rt = imin(rt0 + r, NT - 1);
    wp[r] = wq + ((u64)rt * KCH + c_begin) * 32 + lane;
    sp[r] = wsc + ((u64)rt * KCH + c_begin) * 32 + lane;
  }
  // Tokens past M load row M-1: the MMA keeps token columns apart, and the epilogue drops them.
  const u16* xrow[MT];
#pragma unroll
  for (int j = 0; j < MT; j++) xrow[j] = x + (u64)imin(8 * j + g, M - 1) * ldx + c_begin * 64 + 16 * q;

  // A ring of ST chunks in flight per warp: weights straight to registers, no shared memory.
  // Every load is unconditional (past the end it re-reads the last chunk): a predicated load into a
  // ring slot makes the compiler copy the slot, and the copy waits for the load.
  u32x4 wb[ST][RT];
  u32 sb[ST][RT];
#pragma unroll
  for (int s = 0; s < ST; s++)
#pragma unroll
    for (int r = 0; r < RT; r++) {
      wb[s][r] = ld_stream(wp[r] + imin(s, nch - 1) * 32);
      sb[s][r] = ld_stream_u16(sp[r] + imin(s, nch - 1) * 32);
    }

#if XSM
  // Many tokens: the CTA stages each chunk's activations in shared memory once (cp.async, XST deep)
  // and its warps read their B fragments there, instead of every warp re-reading them from L2.
  // Rows of 144 bytes (128 + 16 of padding) keep a quarter-warp's 16-byte reads on distinct banks.
  __shared__ u32x4 xs[XST][MT * 8][9];
  auto stage_x = [&](int c) {
    const int cc = imin(c, nch - 1);
    for (int i = threadIdx.x; i < MT * 8 * 8; i += WARPS * 32) {
      const int row = i >> 3, part = i & 7;
      const u16* src = x + (u64)imin(row, M - 1) * ldx + (c_begin + cc) * 64 + part * 8;
      const u32 dst = smem_addr(&xs[c % XST][row][part]);
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };
#pragma unroll
  for (int s = 0; s < XST - 1; s++) stage_x(s);
#else
  // Few tokens: each warp loads its fragments (L1 serves the CTA's other warps), one chunk ahead,
  // into two buffers used by alternate chunks (ST is even), so no register copies wait on loads.
  u32x4 xv[2][MT][2];
  auto load_x = [&](int c, int buf) {
    const int cc = imin(c, nch - 1);
#pragma unroll
    for (int j = 0; j < MT; j++) {
      xv[buf][j][0] = ld_act(xrow[j] + cc * 64);
      xv[buf][j][1] = ld_act(xrow[j] + cc * 64 + 8);
    }
  };
  load_x(0, 0);
#endif
  // DUAL: odd k-steps accumulate apart, so consecutive MMAs do not wait on each other.
  float acc2[DUAL ? RT : 1][DUAL ? MT : 1][4];
#pragma unroll
  for (int r = 0; r < (DUAL ? RT : 1); r++)
#pragma unroll
    for (int j = 0; j < (DUAL ? MT : 1); j++) acc2[r][j][0] = acc2[r][j][1] = acc2[r][j][2] = acc2[r][j][3] = 0.f;

  // One chunk: slot s holds chunk c; `ahead` refills the slot with chunk c + ST. In the steady
  // state (all of the next ST chunks in range) the addresses need no clamping.
  auto body = [&](const int c, const int s, const bool ahead, const bool steady) {
    u32x4 xc[MT][2];
#if XSM
    asm volatile("cp.async.wait_group %0;" ::"n"(XST - 2) : "memory");
    __syncthreads();  // chunk c is in; every warp is done with the stage chunk c + XST - 1 reuses
    stage_x(c + XST - 1);
#pragma unroll
    for (int j = 0; j < MT; j++) {
      xc[j][0] = xs[c % XST][8 * j + g][2 * q];
      xc[j][1] = xs[c % XST][8 * j + g][2 * q + 1];
    }
#else
    const int cur = s & 1, nxt = cur ^ 1;
#pragma unroll
    for (int j = 0; j < MT; j++) xc[j][0] = xv[cur][j][0], xc[j][1] = xv[cur][j][1];
    if (steady) {
#pragma unroll
      for (int j = 0; j < MT; j++) {
        xv[nxt][j][0] = ld_act(xrow[j] + (c + 1) * 64);
        xv[nxt][j][1] = ld_act(xrow[j] + (c + 1) * 64 + 8);
      }
    } else {
      load_x(c + 1, nxt);
    }
#endif
    u32x4 w[RT];
    u32 sl[RT], sh[RT];
#pragma unroll
    for (int r = 0; r < RT; r++) {
      w[r] = wb[s][r];
      scales(sb[s][r], sl[r], sh[r]);
      if (ahead) {
        wb[s][r] = ld_stream(wp[r] + (c + ST) * 32);
        sb[s][r] = ld_stream_u16(sp[r] + (c + ST) * 32);
      }
    }
#pragma unroll
    for (int t = 0; t < 4; t++) {
#pragma unroll
      for (int r = 0; r < RT; r++) {
        const u32 v = t == 0 ? w[r].x : t == 1 ? w[r].y : t == 2 ? w[r].z : w[r].w;
        u32 a0, a1, a2, a3;
        decode_word(v, sl[r], sh[r], a0, a1, a2, a3);
#pragma unroll
        for (int j = 0; j < MT; j++) {
          const u32x4& xx = xc[j][t >> 1];
          const u32 b0 = (t & 1) ? xx.z : xx.x, b1 = (t & 1) ? xx.w : xx.y;
          if (DUAL && (t & 1))
            mma_bf16(acc2[DUAL ? r : 0][DUAL ? j : 0], a0, a1, a2, a3, b0, b1);
          else
            mma_bf16(acc[r][j], a0, a1, a2, a3, b0, b1);
        }
      }
    }
  };
  int c0 = 0;
  for (; c0 + 2 * ST <= nch; c0 += ST) {
#pragma unroll
    for (int s = 0; s < ST; s++) body(c0 + s, s, true, true);
  }
  // The last ST .. 2ST-1 chunks (fewer when nch < ST): refills only while in range.
#pragma unroll
  for (int s = 0; s < ST; s++)
    if (c0 + s < nch) body(c0 + s, s, c0 + s + ST < nch, false);
#pragma unroll
  for (int s = 0; s < ST; s++)
    if (c0 + ST + s < nch) body(c0 + ST + s, s, false, false);
#if XSM
  asm volatile("cp.async.wait_group 0;" ::: "memory");
#endif
  if (DUAL) {
#pragma unroll
    for (int r = 0; r < RT; r++)
#pragma unroll
      for (int j = 0; j < MT; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[r][j][e] += acc2[DUAL ? r : 0][DUAL ? j : 0][e];
  }

  if (S > 1) {
    // Partial sums in fragment order [split][tile][MT][lane] (coalesced float4 per lane).
#pragma unroll
    for (int r = 0; r < RT; r++)
      if (rt0 + r < NT)
#pragma unroll
        for (int j = 0; j < MT; j++)
          st_f32x4(&part[(((u64)split * NT + rt0 + r) * MT + j) * 32 + lane], acc[r][j]);
    __threadfence();
    __syncthreads();
    __shared__ int is_last;
    if (threadIdx.x == 0) {
      const int ticket = atomicAdd(&counters[bx], 1);
      is_last = ticket == S - 1;
      if (is_last) counters[bx] = 0;  // ready for the next launch (graph replays too)
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
#pragma unroll
    for (int r = 0; r < RT; r++)
      if (rt0 + r < NT)
#pragma unroll
        for (int j = 0; j < MT; j++) {
          float a[4] = {0.f, 0.f, 0.f, 0.f}, p[4];
          for (int s = 0; s < S; s++) {  // split order: the same bits every run
            ld_f32x4_l2(&part[(((u64)s * NT + rt0 + r) * MT + j) * 32 + lane], p);
            a[0] += p[0]; a[1] += p[1]; a[2] += p[2]; a[3] += p[3];
          }
          acc[r][j][0] = a[0]; acc[r][j][1] = a[1]; acc[r][j][2] = a[2]; acc[r][j][3] = a[3];
        }
  }

  // Epilogue: c0,c1 = (row g, tokens 2q, 2q+1), c2,c3 = (row g+8, same tokens) of each 16 x 8 tile.
  if (FUSE_SHRINK) {  // the shrink CTAs took the first tickets, so they run and never wait: no deadlock
    if (threadIdx.x == 0)
      while (ld_acquire(xa_ready) < shrink_ctas) {
      }
    __syncthreads();
  }
  const float f = *out_factor;
#pragma unroll
  for (int r = 0; r < RT; r++) {
    const int rt = rt0 + r;
    if (rt >= NT) continue;
    const int row0 = rt * 16 + g, row1 = row0 + 8;
    float b0 = 0.f, b1 = 0.f;
    if (HAS_BIAS) {
      b0 = bf16_to_f32(bias[row0]);
      b1 = bf16_to_f32(bias[row1]);
    }
#pragma unroll
    for (int j = 0; j < MT; j++) {
      float o[4] = {acc[r][j][0] * f + b0, acc[r][j][1] * f + b0, acc[r][j][2] * f + b1, acc[r][j][3] * f + b1};
      if (HAS_LORA) {
        // scaling * B[rows] @ xa[tokens, segment]^T as one more MMA per 16 of rank (B rows are A here).
        const int seg = (rt * 16 >= seg1) + (rt * 16 >= seg2);
        const int tok_b = 8 * j + g;
        const u16* xr = xa + (u64)imin(tok_b, M - 1) * ldxa + seg * rank;
        float l[4] = {0.f, 0.f, 0.f, 0.f};
        for (int k0 = 0; k0 < rank; k0 += 16) {
          const int ka = k0 + 2 * q, kb = ka + 8;
          const u32 a0 = ka < rank ? ld_u32(lb + (u64)row0 * rank + ka) : 0u;
          const u32 a1 = ka < rank ? ld_u32(lb + (u64)row1 * rank + ka) : 0u;
          const u32 a2 = kb < rank ? ld_u32(lb + (u64)row0 * rank + kb) : 0u;
          const u32 a3 = kb < rank ? ld_u32(lb + (u64)row1 * rank + kb) : 0u;
          const u32 x0 = ka < rank ? (FUSE_SHRINK ? ld_u32_l2(xr + ka) : ld_u32(xr + ka)) : 0u;
          const u32 x1 = kb < rank ? (FUSE_SHRINK ? ld_u32_l2(xr + kb) : ld_u32(xr + kb)) : 0u;
          mma_bf16(l, a0, a1, a2, a3, x0, x1);
        }
        const float sc = (float)lora_scaling;
        o[0] += l[0] * sc; o[1] += l[1] * sc; o[2] += l[2] * sc; o[3] += l[3] * sc;
      }
      const int t0 = 8 * j + 2 * q;
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
}

extern "C" __global__ void __launch_bounds__(WARPS * 32) w4_mma_matmul(
    const u32x4* __restrict__ wq, const u16* __restrict__ wsc, const u16* __restrict__ x,
    u16* __restrict__ y, f32x4* __restrict__ part, int* __restrict__ counters,
    const float* __restrict__ out_factor, const u16* __restrict__ bias, u16* __restrict__ xa,
    const u16* __restrict__ lb, double lora_scaling, int rank, int seg1, int seg2,
    int M, int N, int K, int ldx, int ldy, int ldxa, int chunks_per_split,
    const u16* __restrict__ lora_a, int shrink_ctas, int splits, int sync_base) {
  if (!FUSE_SHRINK) {
    matmul_cta(blockIdx.x, blockIdx.y, gridDim.y, wq, wsc, x, y, part, counters, out_factor, bias, xa, lb,
               lora_scaling, rank, seg1, seg2, M, N, K, ldx, ldy, ldxa, chunks_per_split, counters, 0);
    return;
  }
  // Roles by ticket, in the order CTAs start: tickets 0..shrink_ctas-1 compute xa, the rest the
  // matmul (whose epilogue waits for xa). sync: [ticket, xa_ready, finished] counters.
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
    const int m = t - shrink_ctas, blocks = gridDim.x - shrink_ctas;
    const int row_blocks = blocks / splits;
    matmul_cta(m % row_blocks, m / row_blocks, splits, wq, wsc, x, y, part, counters, out_factor, bias, xa, lb,
               lora_scaling, rank, seg1, seg2, M, N, K, ldx, ldy, ldxa, chunks_per_split, &sync[1], shrink_ctas);
  }
  __syncthreads();
  if (threadIdx.x == 0 && atomicAdd(&sync[2], 1) == gridDim.x - 1) {
    sync[0] = 0;  // the last CTA to finish: every other one is done with the counters
    sync[1] = 0;
    sync[2] = 0;
  }
}

// Large M: the bf16 weights W * gs (no 1/gs, which cuBLAS applies as alpha), rows in natural order.
// One thread per (tile, chunk, lane): 16 bytes in, 2 x 32 bytes out (rows g and g+8).
extern "C" __global__ void w4_mma_dequantize(const u32x4* __restrict__ wq, const u16* __restrict__ wsc,
                                             u32x4* __restrict__ out, int N, int K) {
  const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  const int KCH = K >> 6;
  if (i >= (u64)(N >> 4) * KCH * 32) return;
  const int lane = i & 31, g = lane >> 2, q = lane & 3;
  const u64 tc = i >> 5;
  const int c = tc % KCH, rt = tc / KCH;
  const u32x4 w = ld_stream(wq + i);
  u32 sl, sh;
  scales(ld_stream_u16(wsc + i), sl, sh);
  const u32 two7 = 0x43004300u;  // 128.0 in both halves: restores the 2^-7 of the decode, exactly
  u32 r0[8], r1[8];
#pragma unroll
  for (int t = 0; t < 4; t++) {
    const u32 v = t == 0 ? w.x : t == 1 ? w.y : t == 2 ? w.z : w.w;
    u32 a0, a1, a2, a3;
    decode_word(v, sl, sh, a0, a1, a2, a3);
    r0[2 * t] = bmul2(a0, two7);
    r1[2 * t] = bmul2(a1, two7);
    r0[2 * t + 1] = bmul2(a2, two7);
    r1[2 * t + 1] = bmul2(a3, two7);
  }
  // Row g, inputs 64c + 16q .. +15 are 32 contiguous bytes: two 16-byte stores per row.
  u32x4* o0 = out + (((u64)(rt * 16 + g) * K) + c * 64 + 16 * q) / 8;
  u32x4* o1 = out + (((u64)(rt * 16 + g + 8) * K) + c * 64 + 16 * q) / 8;
  o0[0] = u32x4{r0[0], r0[1], r0[2], r0[3]};
  o0[1] = u32x4{r0[4], r0[5], r0[6], r0[7]};
  o1[0] = u32x4{r1[0], r1[1], r1[2], r1[3]};
  o1[1] = u32x4{r1[4], r1[5], r1[6], r1[7]};
}
