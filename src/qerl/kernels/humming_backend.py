"""humming-kernels (the W4A16 library vLLM and SGLang use as a linear backend) as one of qerl's measured paths.

Why a library here: on sm_90 it runs the weights as wgmma's register operand with TMA, warp
specialization and stream-K, the Hopper structure our own kernels lack (../shared/docs/kernel-anchors.md);
on the H200 it was 1.2-1.45x faster than our routed path at M 32-2048 (issue 47). We use it as it is
and keep our effort for what it does not do: the LoRA term runs beside it (one shrink per fused group,
one expand launch for all its segments, added into its output).

humming takes compressed-tensors' NVFP4/MXFP4 tensors (`weight_packed`, `weight_scale`, and NVFP4's
`weight_global_scale`) and repacks them into its own layout once (`HummingWeight.build`, timed). The
package is optional: the CPU install and tests run without it, and where it cannot import or JIT,
`available()` says so in one line and qerl keeps its own kernels.
"""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import dataclass

import torch

from . import lora_expand, lora_shrink, routes, settings
from .dispatch import LoraTerm

PIN = "0.1.20"  # pyproject's `cuda` extra installs exactly this
_AVAILABLE: dict[int, bool] = {}

# compressed-tensors' description of each format, as humming's schema reads it.
CT_CONFIGS = {
    "nvfp4": dict(quant_method="compressed-tensors", format="nvfp4-pack-quantized", type="float", num_bits=4,
                  strategy="tensor_group", group_size=16, symmetric=True),
    "mxfp4": dict(quant_method="compressed-tensors", format="mxfp4-pack-quantized", type="float", num_bits=4,
                  strategy="group", group_size=32, symmetric=True),
}


def available(device: torch.device | None = None) -> bool:
    """humming imports and this GPU is sm_80+ (its NVRTC JIT needs a CUDA toolkit's headers). Said once."""
    if not torch.cuda.is_available():
        return False
    idx = torch.cuda.current_device() if device is None or device.index is None else device.index
    if idx not in _AVAILABLE:
        ok, why = False, ""
        try:
            import humming  # noqa: F401
            from humming.layer import HummingLayer  # noqa: F401
            major, _ = torch.cuda.get_device_capability(idx)
            ok, why = major >= 8, f"sm_{major}x is below sm_80"
        except Exception as e:  # not installed, or its launcher failed to build
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        if not ok:
            warnings.warn(f"qerl: humming-kernels unavailable ({why}); using qerl's own kernels", stacklevel=2)
        _AVAILABLE[idx] = ok
    return _AVAILABLE[idx]


def supports_shape(shape: tuple[int, int]) -> bool:
    """humming's repack tiles 64 output rows by 32 inputs (humming/transform.py transform_humming_weight), and its
    sm_90 heuristics need blocks of 128 rows (tune/sm90_policies.py asserts it for N = 1088)."""
    n, k = shape
    return n % 128 == 0 and k % 32 == 0


# A humming copy is a second copy of the weight (until humming's layout is the stored one): never let the copies
# take the memory a training step needs. Whether they are made on a device is decided once, when a model loads
# (`plan_copies`), from what this process holds then and the card's size: never from the free memory at a first call,
# so the same run on the same card always runs the same kernels.
COPY_SHARE = 0.6  # the process's memory at load plus every copy must stay within this share of the card
_COPIES: dict[int, bool] = {}


def plan_copies(shapes: list[tuple[int, int]], device: torch.device) -> bool:
    """Decide, at load, whether humming copies of these [N, K] NVFP4 weights (0.5625 B a weight) fit on `device`:
    the memory allocated now (the loaded model) plus all of them within COPY_SHARE of the card. All or none, said
    in one line when none: those weights stay on qerl's own kernels at every M."""
    device = torch.device(device)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    need = sum(n * k * 9 // 16 for n, k in shapes)
    held, total = torch.cuda.memory_allocated(idx), torch.cuda.get_device_properties(idx).total_memory
    fits = held + need <= COPY_SHARE * total
    if not fits and shapes:
        warnings.warn(f"qerl: humming-kernels copies of {len(shapes)} weights ({need / 2**30:.1f} GiB) do not fit "
                      f"beside the model ({held / 2**30:.1f} of {total / 2**30:.1f} GiB held; both must stay within "
                      f"{COPY_SHARE:.0%} of the card): qerl's own kernels serve every M (humming_storage: one copy)",
                      stacklevel=2)
    _COPIES[idx] = fits
    return fits


def copy_fits(shape: tuple[int, int], device: torch.device) -> bool:
    """Whether this device may hold humming copies: the load's decision (`plan_copies`); yes where no model was
    planned (weights built by hand: benches, tests)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return _COPIES.get(idx, True)


# humming's default config splits K across CTAs (stream-K) at M 1-256 and its partial sums land in a varying order:
# on an H100 every call gave other bits (up to 0.125 on a 4608x3584 weight; benchmarks/kernels.md), so
# seeded rollouts did not repeat and graphs disagreed with eager steps (tests/test_rollout_gpu.py: 4 failures).
# Batch-invariant tiles (no stream-K) repeat bit for bit, at +5-13 % at M 16-2048 in an eager timing.
COMPUTE = {"use_batch_invariant": True}


_NOSPLIT: dict[tuple, str] = {}


def nosplit_entries(entries: list) -> list:
    """humming's per-M tile configs ([m_lo, m_hi, config] intervals) with stream-K off: each output tile is
    summed by one CTA in a fixed K order, so a call repeats bit for bit (not batch-invariant: another M may take
    other tiles), while the tiles keep their default K depth. Why a candidate: batch-invariant tiles force
    block_k = warp_k = 32 (humming/tune/base.py) and measured 2.0-2.6x slower than stream-K in graphs."""
    return [[lo, hi, {**cfg, "use_stream_k": False}] for lo, hi, cfg in entries]


def nosplit_tuning(layer_config, device: torch.device, gemm_type: str = "dense") -> str:
    """`nosplit_entries` of humming's default heuristics for this layer config, as the JSON string humming's
    forward takes (a list it would serialize again on every call), once per (config, device, GEMM type)."""
    from humming.tune import get_heuristics_config

    # to_str() of a transformed (frozen) config is a stored string, so the lookup on every routed call is cheap
    key = (layer_config.to_str(), device.index, gemm_type)
    if key not in _NOSPLIT:
        _NOSPLIT[key] = json.dumps(nosplit_entries(get_heuristics_config(layer_config, None, gemm_type=gemm_type,
                                                                         device=device)))
    return _NOSPLIT[key]


_SK2: dict[tuple, str] = {}


def sk2_tuning(layer_config, device: torch.device, gemm_type: str = "dense") -> str:
    """humming's default heuristics for this layer config with each stream-K grid narrowed to one that cuts no tile
    into more than two slices (kernels/humming_sk2.py: bit-repeatable), as the JSON string humming's forward takes,
    once per (config, device, GEMM type)."""
    from humming.tune import get_heuristics_config

    from .humming_sk2 import sk2_entries

    key = (layer_config.to_str(), device.index, gemm_type)
    if key not in _SK2:
        entries = get_heuristics_config(layer_config, None, gemm_type=gemm_type, device=device)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        _SK2[key] = json.dumps(sk2_entries(entries, (layer_config.shape_n, layer_config.shape_k), sms))
    return _SK2[key]


def call_configs(backend: str, layer_config, device: torch.device) -> tuple[dict | None, str | None]:
    """(compute_config, tuning_config) of the humming kernel a routes name means (kernels/routes.py HUMMING):
    humming_bi batch-invariant tiles, humming_ns its tiles without split, humming_sk its own default (stream-K,
    partial sums in arrival order), humming_sk2 its stream-K with at most two slices a tile (repeatable)."""
    if backend == "humming_bi":
        return COMPUTE, None
    if backend == "humming_ns":
        return None, nosplit_tuning(layer_config, device)
    if backend == "humming_sk":
        return None, None
    if backend == "humming_sk2":
        return None, sk2_tuning(layer_config, device)
    raise ValueError(f"humming backend: {backend!r} is not one of humming_bi, humming_ns, humming_sk, humming_sk2")


@dataclass
class HummingWeight:
    """One frozen weight in humming's layout, and how long the repack took."""

    layer: torch.nn.Module
    n: int
    k: int
    repack_s: float

    @classmethod
    def build(cls, fmt_name: str, tensors: dict[str, torch.Tensor], shape: tuple[int, int],
              dtype: torch.dtype = torch.bfloat16) -> "HummingWeight":
        """Repack compressed-tensors tensors (on the GPU) into humming's layout. The inputs are not kept."""
        from humming.layer import HummingLayer

        if fmt_name not in CT_CONFIGS:
            raise ValueError(f"humming backend: format {fmt_name!r} is not one of {sorted(CT_CONFIGS)}")
        n, k = shape
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dev = tensors["weight_packed"].device
        with torch.device(dev):
            layer = HummingLayer(shape_n=n, shape_k=k, weight_config=dict(CT_CONFIGS[fmt_name]), torch_dtype=dtype)
        layer.load_from_tensors({name: t.to(dev) for name, t in tensors.items()})
        layer.transform()
        torch.cuda.synchronize()
        return cls(layer, n, k, time.perf_counter() - t0)

    def matmul(self, x2d: torch.Tensor, bias: torch.Tensor | None = None, lora: LoraTerm | None = None,
               backend: str = "humming_ns"):
        """x2d [M, K] bf16 -> x2d @ W.T (+ bias) (+ the LoRA term) [M, N] bf16, in the routed humming mode."""
        lora, pending = start_lora(lora, x2d)
        cc, tc = call_configs(backend, self.layer.humming_config, x2d.device)
        return end_lora(self.run(x2d, cc, tc), lora, pending, bias)

    def run(self, x2d: torch.Tensor, compute_config=None, tuning_config=None) -> torch.Tensor:
        """humming's forward of this weight with the current stream's lock buffer (`_locks`): the layer's own buffer
        is one for every stream, and two streams splitting K at once would wait on each other's locks."""
        from humming.forward import humming_forward

        lay = self.layer
        return humming_forward(lay.humming_config, inputs=x2d, weight=lay.weight,
                               weight_scale=getattr(lay, "weight_scale", None),
                               weight_scale_2=getattr(lay, "weight_scale_2", None), locks=_locks(x2d.device),
                               compute_config=compute_config, tuning_config=tuning_config)


def start_lora(lora: LoraTerm | None, x2d: torch.Tensor):
    """Before a humming GEMM: (the term with xa, None), or (None, the shrink started beside it) under
    KernelSettings.lora_overlap."""
    if lora is None or lora.xa is not None:
        return lora, None
    if settings.current().lora_overlap and x2d.is_cuda:
        return None, lora_shrink.begin(lora, x2d)
    return lora_shrink.shrunk(lora, x2d), None


def end_lora(y: torch.Tensor, lora: LoraTerm | None, pending, bias: torch.Tensor | None = None) -> torch.Tensor:
    """After it: y (+ bias) (+ the LoRA term), joining a shrink started beside the GEMM."""
    if pending is not None:
        lora = lora_shrink.finish(pending)
    if lora is not None:
        return add_lora_term(y, lora, bias)
    return y if bias is None else y + bias


def add_lora_term(y: torch.Tensor, lora: LoraTerm, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y[:, rows of s] += scaling * xa_s @ b_s.T (+ bias) in place: one Triton launch for all segments and the bias
    (kernels/lora_expand.py), else one cuBLAS addmm per segment. Both read B itself (no cached copy): a CUDA graph captured in one rollout
    replays in the next, after an optimizer step has changed B in place. xa must be given."""
    n_seg = len(lora.seg_starts) + 1
    if settings.current().lora_expand_kernel and lora_expand.supports(y, lora.xa, lora.b, n_seg):
        return lora_expand.expand_add(y, lora.xa, lora.b, lora.scaling, lora.seg_starts, bias)
    if bias is not None:
        y += bias
    r, n = lora.rank, lora.b.shape[0]
    bounds = (0, *lora.seg_starts, n)
    xa = lora.xa.to(y.dtype)
    b = lora.b if lora.b.dtype == y.dtype else lora.b.to(y.dtype)
    for s in range(len(bounds) - 1):
        rows = slice(bounds[s], bounds[s + 1])
        y[:, rows].addmm_(xa[:, s * r:(s + 1) * r], b[rows].t(), alpha=lora.scaling)
    return y


# ---------------------------------------------------------------------------------------------------
# The stored layout (formats/nvfp4_humming.py): humming's tensors are the layer's own buffers, one copy.
# ---------------------------------------------------------------------------------------------------

_CONFIGS: dict[tuple, object] = {}
_LOCKS: dict[tuple, torch.Tensor] = {}
LOCKS = 2048  # humming's stream-K lock buffer (its HummingLayer allocates this many int32 a layer)


def _locks(device: torch.device) -> torch.Tensor:
    """humming's lock buffer for the current stream of `device`: one a (device, stream), as kernels/counters.py
    keeps split-K counters. Launches on one stream run in order and leave their locks zeroed, so they may share it;
    two streams at once (a rollout beside an update) may not. A captured graph keeps its capture stream's."""
    key = (device.index, torch.cuda.current_stream(device).cuda_stream)
    buf = _LOCKS.get(key)
    if buf is None:
        buf = _LOCKS[key] = torch.zeros(LOCKS, dtype=torch.int32, device=device)
    return buf


def _layer_config(n: int, k: int, device: torch.device, experts: int | None = None):
    """humming's LayerConfig for an [n, k] NVFP4 weight (or `experts` of them, the grouped GEMMs') with bf16
    activations: it depends on the shape and dtypes only, so it is made once per shape by transforming a zero
    weight (freed at once) and then serves every stored weight of that shape."""
    key = (n, k, device, experts)
    if key not in _CONFIGS:
        from humming.layer import HummingLayer

        lead = () if experts is None else (experts,)
        with torch.device(device):
            layer = HummingLayer(shape_n=n, shape_k=k, weight_config=dict(CT_CONFIGS["nvfp4"]), num_experts=experts,
                                 torch_dtype=torch.bfloat16)
        layer.load_from_tensors({"weight_packed": torch.zeros(*lead, n, k // 2, dtype=torch.uint8, device=device),
                                 "weight_scale": torch.ones(*lead, n, k // 16, device=device).to(torch.float8_e4m3fn),
                                 "weight_global_scale": torch.ones(*(lead or (1,)), device=device)})
        layer.transform()
        _CONFIGS[key] = layer.humming_config
    return _CONFIGS[key]


def stored_supports(x: torch.Tensor, fmt) -> bool:
    return getattr(fmt, "layout", None) == "humming" and x.is_cuda and available(x.device)


def stored_matmul(x, fmt, tensors, shape, bias=None, lora=None):
    """x [..., K] @ W.T (+ bias) (+ LoRA) straight from the stored humming tensors, at every M. A fused
    group's member alone (a column view of the group's storage, the member-by-member reference path)
    is not contiguous for humming: it dequantizes and runs cuBLAS."""
    from humming.forward import humming_forward

    n, k = shape
    dtype = x.dtype
    x2d = x.reshape(-1, k).to(torch.bfloat16).contiguous()
    b = None if bias is None else bias.to(torch.bfloat16)
    w, s = tensors["weight_packed"], tensors["weight_scale"]
    if w.is_contiguous() and s.is_contiguous():
        lora, pending = start_lora(lora, x2d)
        # every M runs on humming here; the table's stored lists say in which of its modes
        route = routes.pick(x2d.shape[0], w.device, shape, stored=True)
        if route in routes.KSPLIT:  # routes.pick gave humming_ns where K does not split
            from .humming_ksplit import stored_product

            y = stored_product(x2d, tensors, shape, routes.KSPLIT[route], _locks(w.device))
        else:
            config = _layer_config(n, k, w.device)
            cc, tc = call_configs(route, config, w.device)
            y = humming_forward(config, inputs=x2d, weight=w, weight_scale=s, weight_scale_2=tensors["weight_scale_2"],
                                locks=_locks(w.device), compute_config=cc, tuning_config=tc)
        y = end_lora(y, lora, pending, b)
    else:
        if lora is not None and lora.xa is None:
            lora = lora_shrink.shrunk(lora, x2d)
        y = torch.nn.functional.linear(x2d, fmt.dequantize(tensors, shape, torch.bfloat16), b)
        if lora is not None:
            y = add_lora_term(y, lora)
    return y.view(*x.shape[:-1], n).to(dtype)


def stored_matmul_grad_input(gy, fmt, tensors, shape):
    """dX = dY @ W from the same bytes: one dequantize (formats/humming_layout.dequantize_bf16) + cuBLAS."""
    n, k = shape
    g2d = gy.reshape(-1, n).to(torch.bfloat16)
    g = g2d @ fmt.dequantize(tensors, shape, torch.bfloat16)
    return g.view(*gy.shape[:-1], k).to(gy.dtype)
