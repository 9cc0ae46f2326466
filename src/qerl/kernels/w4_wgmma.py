"""The Hopper NVFP4 kernel for many tokens (w4_wgmma.cu): wgmma with weights decoded in registers.

The mma.sync kernel (w4_mma.py) re-decodes every weight for each 8 tokens' worth of MMAs and keeps
96-177 registers of fragments, so past M = 16 it falls behind bf16 (benchmarks/kernels.md: 0.94x at
32, 0.60x at 64; dequantize + cuBLAS 0.36x at 128). Here a warpgroup decodes each weight once per
CTA into wgmma's register-sourced A operand and multiplies it with up to 256 tokens from shared
memory; the same bytes as the mma.sync kernel (formats/nvfp4_mma.py), so the two share one copy of
the weights and `mma_backend` picks by M.

Roofline of the 7B layer set (q|k|v, o, gate|up, down; 233 M weights): 131 MB of NVFP4 = 30.7 us at
~4.2 TB/s; 466 MFLOP a token = 0.6 us a token at ~790 TFLOP/s. Bytes bound up to M ~ 50, the MMA
beyond: M = 64 -> ~39 us floor (cuBLAS bf16 ~148 us), 128 -> ~77 us, 256 -> ~151 us (cuBLAS
bf16 is MMA bound there too: the target is parity). So past M ~ 64 the MMA must never wait: the
kernel is warp-specialised (producer warps only issue cp.async, consumer warpgroups only decode and
MMA, mbarriers between them), the activations go straight into the swizzled B tile by 4-byte
cp.async (no staging copy, no permute pass), and each chunk's 4 wgmmas run while the next chunk
decodes. Decode: 9 integer ops + 4 bf16x2 multiplies a word of 8 weights, ~1.6 thread-instructions
a weight, once per CTA.

On by default (`KernelSettings.wgmma`) for w4_wgmma.ROUTE_MIN_M..MAX_M tokens: tests/test_w4_wgmma_gpu.py
passed on an H100 and an H200, and it beat mma.sync from M 64 (benchmarks/kernels.md).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, fields

import torch

from ..formats.nvfp4_mma import BITS, RECIPE
from . import counters, nvrtc, settings
from .m_thresholds import W4_WGMMA_MAX_M, W4_WGMMA_MIN_M, W4_WGMMA_ROUTE_MIN_M

log = logging.getLogger(__name__)

FILE, NAME = "w4_wgmma.cu", "w4_wgmma_matmul"
INDEX = "w4_wgmma_index.cuh"  # the address arithmetic, also compiled for the host by the CPU tests
MIN_M, MAX_M = W4_WGMMA_MIN_M, W4_WGMMA_MAX_M  # tokens this kernel takes (kernels/m_thresholds.py)
_COUNTERS = 1 << 14

# Per token tile BN: consumer warpgroups (64 weight rows each), producer warps, stages of the ring, and the
# CTAs per SM the grid is sized for (and ptxas caps registers for: __launch_bounds__'s second argument).
# Shared memory a CTA: stages x (BN x 128 + WG x 2304, rounded up to 1 KB) + 1 KB of alignment slack.
# Chosen by `python -m qerl.bench.kernels --wgmma-sweep` on an H100 (2026-12-05, the 7B layer set): more
# producer warps won at every tile (one warp issuing every copy was the limit), and one warpgroup a CTA
# with more CTAs per SM beat two warpgroups.
TUNING: dict[int, dict] = {
    16: dict(wg=1, pw=4, stages=8, ctas_per_sm=2),
    32: dict(wg=1, pw=4, stages=8, ctas_per_sm=2),  # 128.9 µs; 3 a SM 127.0, spilled with the retired fused shrink
    64: dict(wg=1, pw=2, stages=6, ctas_per_sm=2),
    128: dict(wg=1, pw=4, stages=4, ctas_per_sm=2),
    # One warpgroup: 128 accumulators a thread need the whole 255 registers (two warpgroups spill).
    256: dict(wg=1, pw=4, stages=4, ctas_per_sm=1),
}
# Layers route M >= ROUTE_MIN_M (and <= MAX_M) here, below it to mma.sync (the measurement: m_thresholds.py)
ROUTE_MIN_M = W4_WGMMA_ROUTE_MIN_M
SMEM_LIMIT = 227 * 1024


@dataclass(frozen=True)
class WgmmaConfig:
    """One launch shape: bn tokens and 64*wg weight rows a CTA, pw producer warps, `stages` chunks in the
    ring, `splits` CTAs along K of `chunks_per_split` chunks each, registers capped for `ctas_per_sm`."""

    bn: int
    wg: int
    stages: int
    splits: int
    chunks_per_split: int
    pw: int = 1
    ctas_per_sm: int = 1

    @property
    def threads(self) -> int:
        return 128 * self.wg + 32 * self.pw

    def stage_bytes(self) -> int:  # STAGE_BYTES of w4_wgmma_index.cuh
        return -(-(self.bn * 128 + self.wg * 4 * (512 + 64)) // 1024) * 1024

    def smem_bytes(self) -> int:
        """Dynamic shared memory: the ring, plus 1 KB to align it to the swizzle atom."""
        return self.stages * self.stage_bytes() + 1024

    def static_bytes(self) -> int:
        """Static shared memory besides: the mbarriers and flags (ptxas -v: 16 * stages + 16 bytes)."""
        return 16 * self.stages + 16

    def defines(self, has_bias: bool, has_lora: bool, rank: int = 32) -> dict:
        """rank: the LoRA rank, compiled in so that the expand's B fragments load once a CTA and its loops
        unroll (a runtime rank left every load of the epilogue on one dependent chain: +37 % at M = 64).
        MT and WARPS only let w4_common.cuh's shrink_cta (the mma.sync kernel's) compile; this kernel never calls it."""
        return dict(WG=self.wg, PW=self.pw, BN=self.bn, ST=self.stages, MINB=self.ctas_per_sm,
                    HAS_BIAS=int(has_bias), HAS_LORA=int(has_lora), MT=self.bn // 8,
                    LORA_R=rank if has_lora else 0,
                    WARPS=4 * self.wg + self.pw)

    def grid(self, M: int, N: int) -> tuple[int, int, int]:
        return (math.ceil(N / (64 * self.wg)), math.ceil(M / self.bn), self.splits)


def token_tile(M: int) -> int:
    return min(b for b in TUNING if b >= min(M, MAX_M))


def split_cost_chunks(bn: int) -> int:
    """What a split-K CTA costs beyond its chunks, in chunks by bytes moved: its fp32 partial tile (64 rows x bn x
    4 B) written and read back by the tile's last CTA, against a chunk's 64 x 64 weights (2 KB), their scales (256 B)
    and bn x 64 activations (bf16). 2 at bn 16, 3 at 32, 4 from 64. A model for `wave_splits`, not a fit."""
    return math.ceil(2 * 64 * bn * 4 / (64 * 64 // 2 + 256 + bn * 64 * 2))


def wave_splits(blocks: int, kch: int, slots: int, bn: int, min_chunks: int = 8) -> int:
    """The split of K whose launch takes the fewest chunk-steps: waves (ceil(CTAs / slots)) x (chunks a CTA, plus
    `split_cost_chunks` where split). The fill rule (`plan`'s default) splits only grids smaller than one wave and
    leaves a wide weight's last wave part-empty: gate|up 37888x3584 at M 64 has 592 tiles on 264 slots, 3 waves for
    2.24 of work (168 chunk-steps; split 2: 5 waves x (28 + 4) = 160). Each split keeps >= min_chunks; `plan` may
    launch fewer splits than asked (ceil(kch / ceil(kch / s))), never a longer CTA."""
    best = None
    extra = split_cost_chunks(bn)
    for s in range(1, max(1, kch // min_chunks) + 1):
        cost = math.ceil(blocks * s / slots) * (math.ceil(kch / s) + (extra if s > 1 else 0))
        if best is None or cost < best[0]:
            best = (cost, s)
    return best[1]


def plan(M: int, N: int, K: int, sms: int, *, min_chunks: int = 8, waves: bool = False, **override) -> WgmmaConfig:
    """`ctas_per_sm` CTAs per SM: split along K when the (row block x token tile) grid alone leaves them
    idle, each split at least `min_chunks` chunks. waves=True: the split of `wave_splits` instead (a candidate,
    bench kernels mode wgmma_waves; not measured on a GPU yet)."""
    bn = override.pop("bn", None) or token_tile(M)
    tune = {**TUNING[bn], **override}
    blocks = math.ceil(N / (64 * tune["wg"])) * math.ceil(M / bn)
    kch = K // 64
    cps_sm = tune.get("ctas_per_sm", 1)
    if waves:
        splits = wave_splits(blocks, kch, sms * cps_sm, bn, min_chunks)
    else:
        splits = max(1, min(sms * cps_sm // blocks, kch // min_chunks))
    cps = math.ceil(kch / splits)
    cfg = WgmmaConfig(bn, tune["wg"], tune["stages"], math.ceil(kch / cps), cps, tune.get("pw", 1), cps_sm)
    if (cfg.stages < 2 or cfg.smem_bytes() + cfg.static_bytes() > SMEM_LIMIT or bn % 8 or bn > 256
            or (bn * 8) % (32 * cfg.pw)):
        raise ValueError(f"invalid wgmma launch {cfg}: {cfg.smem_bytes()} bytes of shared memory")
    return cfg


def wgmma_step_source(bn: int) -> str:
    """wgmma_step(acc, a, desc): one m64n{bn}k16 MMA, A from 4 registers, B from a descriptor.
    Generated because the accumulator operand list is as long as bn / 2."""
    n = bn // 2
    d = ", ".join(f"%{i}" for i in range(n))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(n))
    return (
        "__device__ __forceinline__ void wgmma_step(float* d, const u32* a, u64 desc) {\n"
        "  asm volatile(\n"
        f'      "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{n + 5}, 0;\\n"\n'
        f'      "wgmma.mma_async.sync.aligned.m64n{bn}k16.f32.bf16.bf16 {{{d}}}, '
        f'{{%{n}, %{n + 1}, %{n + 2}, %{n + 3}}}, %{n + 4}, p, 1, 1, 0;\\n}}\\n"\n'
        f"      : {outs}\n"
        '      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));\n'
        "}\n")


def pick_source(bits: int = BITS) -> str:
    """pick_r0 / pick_r1 (v, odd): register 2 odd (row g) / 2 odd + 1 (row g + 8) of weight word v, unscaled,
    from formats/nvfp4_mma.RECIPE (BITS 2) or the nibble order (BITS 1). `odd` is a lane's q % 2, fixed per
    thread, so each select is hoisted and a word costs its rotations and masks once (~6 integer ops)."""
    if bits == 1:
        return "".join(
            f"__device__ __forceinline__ u32 pick_r{row}(u32 v, u32 odd) {{ return e2m1x2(v << (odd ? {8 + 4 * row}u : {4 * row}u)); }}\n"
            for row in (0, 1))
    out = []
    for row in (0, 1):
        even, odd = list(RECIPE[2][row]), list(RECIPE[2][2 + row])
        n = max(len(even), len(odd))
        even += [(0, 0)] * (n - len(even))
        odd += [(0, 0)] * (n - len(odd))
        terms = []
        for (re, me), (ro, mo) in zip(even, odd):
            r = f"{re}u" if re == ro else f"(odd ? {ro}u : {re}u)"
            m = f"0x{me:08X}u" if me == mo else f"(odd ? 0x{mo:08X}u : 0x{me:08X}u)"
            terms.append(f"(rotl(v, {r}) & {m})")
        out.append(f"__device__ __forceinline__ u32 pick_r{row}(u32 v, u32 odd) {{ return {' | '.join(terms)}; }}\n")
    return "".join(out)


def generated(cfg: WgmmaConfig) -> dict:
    return {"WGMMA_STEP_DEFINITION": wgmma_step_source(cfg.bn), "WGMMA_PICK_DEFINITION": pick_source()}


@dataclass
class Args:
    """The kernel's parameters, in its order (checked against the source: `_check_arity`)."""

    wq: torch.Tensor
    wsc: torch.Tensor
    x: torch.Tensor
    y: torch.Tensor
    part: torch.Tensor
    counters: torch.Tensor
    out_factor: torch.Tensor
    bias: torch.Tensor
    xa: torch.Tensor
    lb: torch.Tensor
    lora_scaling: float
    rank: int
    seg1: int
    seg2: int
    M: int
    N: int
    K: int
    ldx: int
    ldy: int
    ldxa: int
    chunks_per_split: int
    gx: int
    gy: int
    splits: int


def _check_arity() -> None:
    want = nvrtc.parameters(FILE, NAME)
    have = [f.name for f in fields(Args)]
    if want != have:
        raise RuntimeError(f"{FILE}: {NAME} takes {want}, the launcher passes {have}")


_AVAILABLE: dict = {}


def available(device: torch.device) -> bool:
    """Whether layers use the kernel here: settings.wgmma, sm_90 (wgmma needs sm_90a), and NVRTC compiles it."""
    if not settings.current().wgmma or device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _AVAILABLE:
        ok = torch.cuda.get_device_capability(idx) == (9, 0) and hasattr(torch.cuda, "_compile_kernel")
        if ok:
            try:
                _check_arity()
                _kernel(plan(16, 128, 512, 1), False, False, torch.device("cuda", idx))
            except Exception as e:  # no NVRTC, driver too old, ...
                log.warning("qerl: the NVFP4 wgmma kernel does not compile here (%s); using the other paths", e)
                ok = False
        _AVAILABLE[idx] = ok
    return _AVAILABLE[idx]


_SMEM_SET: dict = {}


def _kernel(cfg: WgmmaConfig, has_bias: bool, has_lora: bool, device, rank: int = 32):
    fn = nvrtc.kernel(FILE, NAME, cfg.defines(has_bias, has_lora, rank), device, generated(cfg))
    if _SMEM_SET.get(id(fn), 0) < cfg.smem_bytes():  # a driver call: once per function, not per launch
        fn.set_shared_memory_config(cfg.smem_bytes())
        _SMEM_SET[id(fn)] = cfg.smem_bytes()
    return fn


def matmul(x2d: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, out_factor: torch.Tensor, N: int,
           bias: torch.Tensor | None = None, lora=None, config: WgmmaConfig | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x2d [M, K] bf16 -> [M, N] bf16 = x @ W^T (* out_factor = 2^7/gs) + bias + LoRA.

    packed/scale: NVFP4 in the MMA layout. lora: a dispatch.LoraTerm (bf16, even rank, <= 3 segments on
    16-row boundaries: w4_mma.lora_fusable) with xa given; a term without xa gets its shrink as its own GEMM
    first (lora.shrunk). The epilogue adds the expand."""
    M, K = x2d.shape
    dev = x2d.device
    cfg = config or plan(M, N, K, torch.cuda.get_device_properties(dev).multi_processor_count)
    if x2d.stride(-1) != 1 or x2d.data_ptr() % 16 or x2d.stride(0) % 8:
        x2d = x2d.contiguous()
    y = out if out is not None else torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    gx, gy, gz = cfg.grid(M, N)
    tiles = gx * gy
    if tiles > _COUNTERS:
        raise ValueError(f"M = {M}, N = {N} needs {tiles} tiles; the counters hold {_COUNTERS}")
    part = (torch.empty(gz * tiles * 128 * cfg.wg * (cfg.bn // 2), device=dev, dtype=torch.float32)
            if gz > 1 else out_factor)
    if lora is not None:
        lora = lora.shrunk(x2d)  # xa given, or the shrink as its own GEMM first
        lb = lora.b.contiguous()
        xa = lora.xa.reshape(M, -1)
        if xa.stride(-1) != 1 or xa.data_ptr() % 4 or xa.stride(0) % 2:
            xa = xa.contiguous()
        segs = list(lora.seg_starts) + [N] * (2 - len(lora.seg_starts))
        lora_part = dict(xa=xa, lb=lb, lora_scaling=float(lora.scaling), rank=lb.shape[1], seg1=segs[0], seg2=segs[1],
                         ldxa=xa.stride(0))
    else:
        lora_part = dict(xa=x2d, lb=x2d, lora_scaling=0.0, rank=0, seg1=N, seg2=N, ldxa=0)
    buf = counters.split_counters(dev)
    args = Args(wq=packed, wsc=scale, x=x2d, y=y, part=part, counters=buf, out_factor=out_factor,
                bias=bias if bias is not None else x2d, M=M, N=N, K=K, ldx=x2d.stride(0), ldy=y.stride(0),
                chunks_per_split=cfg.chunks_per_split, gx=gx, gy=gy, splits=gz, **lora_part)
    kern = _kernel(cfg, bias is not None, lora is not None, dev, lora_part["rank"])
    grid = (gx, gy, gz)
    kern(grid=grid, block=(cfg.threads, 1, 1), args=[getattr(args, f.name) for f in fields(Args)],
         shared_mem=cfg.smem_bytes())
    return y
