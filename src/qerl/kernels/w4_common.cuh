// Helpers shared by the NVFP4 kernels (w4_mma.cu: mma.sync, few tokens; w4_wgmma.cu: wgmma, many tokens),
// prepended to each source by kernels/w4_source.py. Headerless for NVRTC: bf16 values travel as 16-bit
// patterns, conversions and MMAs are inline PTX.
//
// Compile-time: SCALE_BIAS (formats/nvfp4_mma.py), BITS (the bit order inside a weight word, same file).

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;
struct __align__(16) u32x4 { u32 x, y, z, w; };
struct __align__(16) f32x4 { float x, y, z, w; };
__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ void st_f32x4(f32x4* p, const float* v) {
  asm volatile("st.global.v4.f32 [%0], {%1,%2,%3,%4};" :: "l"(p), "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3]) : "memory");
}
__device__ __forceinline__ void ld_f32x4_l2(const f32x4* p, float* v) {  // other SMs' partials: from L2, not L1
  asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(v[0]), "=f"(v[1]), "=f"(v[2]), "=f"(v[3]) : "l"(p) : "memory");
}

__device__ __forceinline__ u32x4 ld_stream(const u32x4* p) {  // weights: read once, keep out of L1
  u32x4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
__device__ __forceinline__ u32 ld_stream_u16(const u16* p) {
  u16 r;
  asm volatile("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(r) : "l"(p));
  return r;
}
__device__ __forceinline__ u32x4 ld_act(const void* p) {  // activations: shared by the CTA's warps via L1
  u32x4 r;
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
__device__ __forceinline__ u32 ld_u32(const void* p) {
  u32 r;
  asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(r) : "l"(p));
  return r;
}
__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
  u32 d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}
__device__ __forceinline__ u32 bmul2(u32 a, u32 b) {
  u32 d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));  // a*b + (-0): exact, sm_80+
  return d;
}
// Two E2M1 codes (sign at bits 15/31, e e m at 14..12 / 30..28) -> bf16x2 of value * 2^-126.
__device__ __forceinline__ u32 e2m1x2(u32 v) { return (v & 0x80008000u) | ((v >> 6) & 0x01C001C0u); }
__device__ __forceinline__ u32 rotl(u32 v, u32 r) {
  u32 d;
  asm("shf.l.wrap.b32 %0, %1, %1, %2;" : "=r"(d) : "r"(v), "r"(r));
  return d;
}
// One weight word -> the four A registers of its k-step, each a bf16x2 of code * scale * 2^-7:
// a0, a2 are row g (scale sl), a1, a3 row g+8 (scale sh). BITS 2: each register's sign and e e m bits
// come out of one or two rotations and masks (nvfp4_mma.RECIPE: 9 integer ops a word); BITS 1: the
// nibble order, shifted by 4i then shift-and-mask (~19).
__device__ __forceinline__ void decode_word(u32 v, u32 sl, u32 sh, u32& a0, u32& a1, u32& a2, u32& a3) {
#if BITS == 1
  a0 = bmul2(e2m1x2(v), sl);
  a1 = bmul2(e2m1x2(v << 4), sh);
  a2 = bmul2(e2m1x2(v << 8), sl);
  a3 = bmul2(e2m1x2(v << 12), sh);
#else
  const u32 m = 0x81C081C0u;
  a0 = bmul2(v & m, sl);
  a1 = bmul2(rotl(v, 4) & m, sh);
  a2 = bmul2(rotl(v, 10) & m, sl);
  a3 = bmul2((rotl(v, 6) & 0x00400040u) | (rotl(v, 14) & 0x81808180u), sh);
#endif
}
__device__ __forceinline__ float bf16_to_f32(u32 h) {
  float f;
  asm("mov.b32 %0, %1;" : "=f"(f) : "r"(h << 16));
  return f;
}
__device__ __forceinline__ u16 f32_to_bf16(float f) {
  u16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
}
__device__ __forceinline__ void mma_bf16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// 2 e5m3 scale bytes (rows g, g+8) -> bf16x2 (scale * 2^119), then each broadcast to both halves.
__device__ __forceinline__ void scales(u32 s, u32& lo, u32& hi) {
  u32 b = (prmt(s, 0u, 0x4140u) << 4) + ((SCALE_BIAS << 7) | (SCALE_BIAS << 23));
  lo = prmt(b, b, 0x1010u);
  hi = prmt(b, b, 0x3232u);
}

__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ u32 ld_u32_l2(const void* p) {  // written by other CTAs of this launch
  u32 r;
  asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(r) : "l"(p) : "memory");
  return r;
}


// The LoRA shrink inside a launch (FUSE_SHRINK): xa[M, R] = x @ A^T for 16 rows of A per CTA, its WARPS
// warps splitting K and adding their parts in warp order (deterministic), rounded to bf16 once; tokens in
// MT tiles of 8 (M <= 8 MT). Both kernels define MT and WARPS.
__device__ __forceinline__ void shrink_cta(int cta, const u16* __restrict__ x, const u16* __restrict__ la,
                                           u16* __restrict__ xa, int R, int M, int K, int ldx) {
  __shared__ f32x4 red[MT][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
  const int row0 = imin(cta * 16 + g, R - 1), row1 = imin(cta * 16 + g + 8, R - 1);
  float acc[MT][4];
#pragma unroll
  for (int j = 0; j < MT; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  for (int k0 = warp * 16; k0 < K; k0 += WARPS * 16) {
    const int ka = k0 + 2 * q, kb = ka + 8;
    const u32 a0 = ld_u32(la + (u64)row0 * K + ka), a1 = ld_u32(la + (u64)row1 * K + ka);
    const u32 a2 = ld_u32(la + (u64)row0 * K + kb), a3 = ld_u32(la + (u64)row1 * K + kb);
#pragma unroll
    for (int j = 0; j < MT; j++) {
      const u16* xr = x + (u64)imin(8 * j + g, M - 1) * ldx;
      mma_bf16(acc[j], a0, a1, a2, a3, ld_u32(xr + ka), ld_u32(xr + kb));
    }
  }
  for (int w = 0; w < WARPS; w++) {  // warps add their parts in order: the same bits every run
    if (warp == w)
#pragma unroll
      for (int j = 0; j < MT; j++) {
        f32x4 v = w ? red[j][lane] : f32x4{0.f, 0.f, 0.f, 0.f};
        v.x += acc[j][0]; v.y += acc[j][1]; v.z += acc[j][2]; v.w += acc[j][3];
        red[j][lane] = v;
      }
    __syncthreads();
  }
  if (warp == 0) {
#pragma unroll
    for (int j = 0; j < MT; j++) {
      const f32x4 v = red[j][lane];
      const float o[4] = {v.x, v.y, v.z, v.w};
      const int t0 = 8 * j + 2 * q, r0 = cta * 16 + g, r1 = r0 + 8;
      if (t0 < M && r0 < R) xa[(u64)t0 * R + r0] = f32_to_bf16(o[0]);
      if (t0 + 1 < M && r0 < R) xa[(u64)(t0 + 1) * R + r0] = f32_to_bf16(o[1]);
      if (t0 < M && r1 < R) xa[(u64)t0 * R + r1] = f32_to_bf16(o[2]);
      if (t0 + 1 < M && r1 < R) xa[(u64)(t0 + 1) * R + r1] = f32_to_bf16(o[3]);
    }
  }
}

