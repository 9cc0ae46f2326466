"""GPU check of training through the fused groups (layers/fused_group.py, `_GroupTrainMatmul`).

    PYTHONPATH=src python scripts/fused_lora_train_gpu.py --out runs/fused_lora_train_gpu
    PYTHONPATH=src python scripts/fused_lora_train_gpu.py --out /tmp/x --device cpu --tiny   # smoke test

One Qwen2.5-7B decoder layer's q|k|v and gate|up groups (random weights, NVFP4 in the layout the
device's kernel reads, as the loader builds them: model/projections.py build_projections; LoRA r 32,
alpha 64, B random so that every gradient path carries signal; bf16). For M tokens (2048, 8192):

1. Time: forward + backward of the members called one by one as the model calls them
   (q_proj(x), k_proj(x), v_proj(x); gate_proj(x), up_proj(x)), through the fused training path
   and through the member path (`members_one_by_one()`): CUDA events, warm-up, median of --iters.
   Also the forward alone, and the number of base matmul / grad-input calls per pass.
2. Agreement: outputs and gradients (x, every lora_A / lora_B) of both paths against an fp32
   reference (the same dequantized weights, plain autograd). Reported: the largest relative error
   ||g - ref|| / ||ref|| over the tensors, and the largest elementwise |g - ref| / max|ref|. The
   fused path passes when its error is within 2x the member path's or under 1e-2 (bf16 noise).

Prints a table; writes results.json under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from qerl.formats import get_format
from qerl.kernels import dispatch
from qerl.layers.fused_group import members_one_by_one
from qerl.model.projections import build_projections
from qerl.model.random_init import QWEN25

QKV, GATE_UP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")


def build_groups(shape: str, rank: int, device, seed: int, std: float = 0.02):
    """{name: (members, group)} for one decoder layer's q|k|v (with biases, as Qwen2) and gate|up."""
    h, inter, _, heads, kv_heads, _ = QWEN25[shape]
    kv = kv_heads * h // heads
    fmt = get_format("nvfp4")
    g = torch.Generator(device=device).manual_seed(seed)
    lora = dict(r=rank, lora_alpha=2.0 * rank, dtype=torch.bfloat16)
    out = {}
    for name, attrs, rows, bias in (("q|k|v", QKV, (h, kv, kv), True), ("gate|up", GATE_UP, (inter, inter), False)):
        ws = [torch.randn(n, h, device=device, generator=g).mul_(std).to(torch.bfloat16) for n in rows]
        gs = fmt.global_scale(ws)
        biases = [torch.randn(n, device=device, generator=g).mul_(std).to(torch.bfloat16) if bias else None
                  for n in rows]
        layers, group = build_projections(list(attrs), [(n, h) for n in rows], biases, fmt, lora, device,
                                          lambda j: fmt.quantize(ws[j], gs), True)
        if group is None:
            raise SystemExit(f"{name}: the members did not fuse")
        with torch.no_grad():
            for m in layers:  # PEFT's B = 0 would leave dA zero and the expand a no-op
                m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, device=device, generator=g) * 0.02)
        out[name] = (layers, group)
    return out


def count_calls():
    """Wrap dispatch's base matmul and grad-input to count their calls."""
    counts = {"fwd": 0, "bwd": 0}
    fwd, bwd = dispatch.base_matmul, dispatch.base_matmul_grad_input

    def f(*a, **kw):
        counts["fwd"] += 1
        return fwd(*a, **kw)

    def b(*a, **kw):
        counts["bwd"] += 1
        return bwd(*a, **kw)

    dispatch.base_matmul, dispatch.base_matmul_grad_input = f, b
    return counts, (fwd, bwd)


def step(members, x, gys, backward=True):
    for m in members:
        m.lora_A.weight.grad = m.lora_B.weight.grad = None
    x.grad = None
    ys = [m(x) for m in members]  # as attention / MLP call them
    if backward:
        torch.autograd.backward(ys, gys)
    return ys


def timed(fn, device, warmup: int, iters: int) -> float:
    """Median milliseconds of fn()."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize(device)
            ts.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def reference(members, x, gys):
    """Outputs and gradients in fp32 from the members' own dequantized weights, plain autograd."""
    xr = x.detach().float().requires_grad_()
    leaves, ys = [], []
    for m in members:
        w = m.dequantized_weight(torch.float32)
        a = m.lora_A.weight.detach().float().requires_grad_()
        b = m.lora_B.weight.detach().float().requires_grad_()
        leaves += [a, b]
        y = F.linear(xr, w, None if m.bias is None else m.bias.float())
        ys.append(y + m.scaling * F.linear(F.linear(xr, a), b))
    torch.autograd.backward(ys, [g.float() for g in gys])
    return [y.detach() for y in ys], [xr.grad] + [t.grad for t in leaves]


def errors(got: list, ref: list) -> tuple[float, float]:
    norm = max(float((g.float() - r).norm() / r.norm().clamp_min(1e-30)) for g, r in zip(got, ref))
    elem = max(float((g.float() - r).abs().max() / r.abs().max().clamp_min(1e-30)) for g, r in zip(got, ref))
    return norm, elem


def run_path(members, x, gys):
    ys = step(members, x, gys)
    grads = [x.grad] + [t for m in members for t in (m.lora_A.weight.grad, m.lora_B.weight.grad)]
    return [y.detach() for y in ys], [g.clone() for g in grads]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for results.json")
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", default="qwen2.5-7b", choices=sorted(QWEN25))
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192], help="M, the tokens of a micro-batch")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="the toy shape and a few tokens (a CPU smoke test)")
    a = p.parse_args(argv)
    if a.tiny:
        a.shape, a.tokens, a.rank, a.warmup, a.iters = "tiny", [32, 64], 4, 1, 2
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (use --device cpu --tiny for a smoke test)")
    groups = build_groups(a.shape, a.rank, device, a.seed)
    g = torch.Generator(device=device).manual_seed(a.seed + 1)
    rows, ok = [], True
    for name, (members, group) in groups.items():
        for M in a.tokens:
            x = torch.randn(M, group.in_features, device=device, generator=g, dtype=torch.bfloat16)
            x.requires_grad_()
            gys = [torch.randn(M, n, device=device, generator=g, dtype=torch.bfloat16) for n in group.rows]
            res = {"group": name, "shape": a.shape, "M": M, "N": group.shape[0], "K": group.shape[1],
                   "rank": a.rank, "fmt": group.fmt.name}
            ref_y, ref_g = reference(members, x, gys)
            for path in ("fused", "members"):
                ctx = members_one_by_one() if path == "members" else contextlib.nullcontext()
                with ctx:
                    counts, real = count_calls()
                    try:
                        ys, grads = run_path(members, x, gys)
                    finally:
                        dispatch.base_matmul, dispatch.base_matmul_grad_input = real
                    res[f"{path}_calls"] = dict(counts)
                    res[f"{path}_out_err"], res[f"{path}_out_err_elem"] = errors(ys, ref_y)
                    res[f"{path}_grad_err"], res[f"{path}_grad_err_elem"] = errors(grads, ref_g)
                    res[f"{path}_fwd_bwd_ms"] = timed(lambda: step(members, x, gys), device, a.warmup, a.iters)
                    res[f"{path}_fwd_ms"] = timed(lambda: step(members, x, gys, backward=False), device,
                                                  a.warmup, a.iters)
            del ref_y, ref_g
            res["speedup_fwd_bwd"] = res["members_fwd_bwd_ms"] / res["fused_fwd_bwd_ms"]
            tol = max(2 * res["members_grad_err"], 1e-2)
            res["ok"] = (res["fused_grad_err"] <= tol and res["fused_out_err"] <= max(2 * res["members_out_err"], 1e-2)
                         and res["fused_calls"] == {"fwd": 1, "bwd": 1})
            ok &= res["ok"]
            rows.append(res)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {dev}; {a.shape}, NVFP4 ({rows[0]['fmt']}), LoRA r{a.rank}, bf16")
    head = (f"{'group':8} {'M':>5} {'fused ms':>9} {'members ms':>10} {'x':>5} {'fwd fused':>9} {'fwd memb':>9} "
            f"{'calls f/m':>13} {'grad err f':>10} {'grad err m':>10} {'ok':>3}")
    print(head)
    for r in rows:
        fc, mc = r["fused_calls"], r["members_calls"]
        calls = f"{fc['fwd']}+{fc['bwd']}/{mc['fwd']}+{mc['bwd']}"
        print(f"{r['group']:8} {r['M']:5d} {r['fused_fwd_bwd_ms']:9.3f} {r['members_fwd_bwd_ms']:10.3f} "
              f"{r['speedup_fwd_bwd']:5.2f} {r['fused_fwd_ms']:9.3f} {r['members_fwd_ms']:9.3f} {calls:>13} "
              f"{r['fused_grad_err']:10.2e} {r['members_grad_err']:10.2e} {'yes' if r['ok'] else 'NO':>3}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": dev, "torch": torch.__version__, "argv": sys.argv[1:], "ok": ok}
    (out / "results.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out / 'results.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
