"""Which host mechanism made the grouped MoE path slow (issue 59 §2): one MoE layer's forward + backward, side by side.

On an H100 the grouped-path rewrite of e37097a (one read of the expert counts a layer, index tensors built on the
host and copied with non_blocking, LoRA over all hit experts at once) made the Qwen3-30B-A3B step's logprob 4.2x and
its update 2.1x slower, and the moe_expert_chunk_mib=1024 run of 700f1db, which shares only the host-built index
tensors (quant_experts._host_chunks), lost about as much (benchmarks/step.md). This times one layer's experts
(random NVFP4, LoRA r32, bf16, uniform top-k routing, gradient on the input and the adapters) through:
  loop16       the library's default grouped path (16 experts a chunk, bounds read chunk by chunk)
  host16       the budgeted path at a 16-expert budget: _host_chunks' one read, index tensors copied non_blocking
  host16_sync  the same with blocking copies (torch.tensor(..., device=...))
  device16     one read of the counts, every index tensor derived on the device (no host-to-device copy), LoRA and
               the bias over all hit experts at once
  host_all     the budgeted path with every expert in one chunk (the 1024 MiB budget measured slow in a step at 700f1db)
  all          no host read at all: every expert dequantized at once, in one grouped matmul a projection with the
               unhit experts as empty groups, the adapters used whole (no gather), every shape fixed by the tokens
and prints, per variant, ms a forward + backward and a no-grad forward (the logprob pass) (--iters passes in a row, no sync between them, as a step's layers
run; after a warm-up pass) and the host's time to enqueue them, checking every variant's output and input gradient
against loop16's. On the CPU (tiny sizes) a smoke test of the variants' agreement. Usage: python3 scripts/ab_grouped.py [--tokens 4096] [--iters 12]
On the device: STEP=ab_grouped bash scripts/device.sh.
"""
import argparse
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from qerl.kernels import settings  # noqa: E402
from qerl.layers import quant_experts as qx  # noqa: E402
from qerl.layers.grouped_mm import frozen_grouped_mm, grouped_mm  # noqa: E402


_HOST_CHUNKS = qx._host_chunks  # the library's, before any patch


def _host_chunks_blocking(counts, num_experts, chunk, device):
    for experts, lo, hi, ends, ids in _HOST_CHUNKS(counts, num_experts, chunk, torch.device("cpu")):
        yield experts, lo, hi, ends.to(device), ids.to(device)  # blocking copies


def device_forward(qe, h, idx, wts):
    """The grouped forward with one read of the counts and no host-to-device copy: the hit experts' ids are the
    first of a stable sort of the 'unhit' flags, their bounds cumulative sums, all on the device."""
    t, k = idx.shape
    e_n = qe.num_experts
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(e_n + 1, dtype=torch.int64, device=flat.device)
    counts.index_add_(0, flat.clamp(0, e_n), torch.ones_like(flat, dtype=torch.int64))
    n = counts.tolist()[:e_n]  # the one host read
    hit = [e for e, c in enumerate(n) if c]
    pairs, chunk = sum(n), qe.chunk_experts(h.dtype)
    ids = torch.argsort((counts[:e_n] == 0).to(torch.int8), stable=True)[:len(hit)]
    cnt = counts[ids]
    ends = torch.cumsum(cnt, 0, dtype=torch.int32)
    x_all = h[order[:pairs] // k]
    starts = [0]
    for c in n:
        starts.append(starts[-1] + c)

    def project(proj, x):
        dt, ys = x.dtype, []  # not x in the weights' closure: the backward keeps it
        for i in range(0, len(hit), chunk):
            experts = hit[i:i + chunk]
            lo, hi = starts[experts[0]], starts[experts[-1] + 1]
            local = torch.cumsum(cnt[i:i + chunk], 0, dtype=torch.int32)
            ys.append(frozen_grouped_mm(x[lo:hi], lambda ex=experts: qe.weights(proj, ex, dt), local))
        y = ys[0] if len(ys) == 1 else torch.cat(ys)
        if qe.r and not qe.disable_adapters:
            a, b = qe.lora_A[proj][ids], qe.lora_B[proj][ids]
            s = grouped_mm(x.to(a.dtype), a.transpose(-2, -1), ends)
            y = y + grouped_mm(s, b.transpose(-2, -1), ends).to(y.dtype) * qe.scaling
        bias = qe.bias(proj)
        if bias is not None:
            y = y + bias[torch.repeat_interleave(ids, cnt, output_size=pairs)]
        return y

    y = project("gate_up_proj", x_all)
    y = project("down_proj", qe.glu(y))
    return qx._sum_pairs([(y * wts.reshape(-1)[order[:pairs], None]).to(h.dtype)], order, t, k, h)


def all_forward(qe, h, idx, wts):
    """The grouped forward with no host read: every expert dequantized at once and one grouped matmul a projection,
    the unhit experts empty groups; a pair routed to no expert (id num_experts) rides the last expert's group with
    weight 0. Every tensor's shape follows from the tokens, so nothing waits for the device."""
    t, k = idx.shape
    e_n = qe.num_experts
    flat = idx.reshape(-1)
    valid = flat < e_n
    key = torch.where(valid, flat, e_n - 1)
    order = torch.argsort(key, stable=True)
    ends = torch.cumsum(torch.bincount(key, minlength=e_n), 0).to(torch.int32)
    experts = key[order]
    every = list(range(e_n))
    x_all = h[order // k]

    def project(proj, x):
        dt = x.dtype
        y = frozen_grouped_mm(x, lambda: qe.weights(proj, every, dt), ends)
        if qe.r and not qe.disable_adapters:
            a, b = qe.lora_A[proj], qe.lora_B[proj]
            s = grouped_mm(x.to(a.dtype), a.transpose(-2, -1), ends)
            y = y + grouped_mm(s, b.transpose(-2, -1), ends).to(y.dtype) * qe.scaling
        bias = qe.bias(proj)
        return y if bias is None else y + bias[experts]

    y = project("down_proj", qe.glu(project("gate_up_proj", x_all)))
    w = torch.where(valid, wts.reshape(-1), 0)[order]
    return qx._sum_pairs([(y * w[:, None]).to(h.dtype)], order, t, k, h)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096, help="a micro-batch's tokens (mb 8 x 512)")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    e, hd, i = a.experts, a.hidden, a.inter
    g = torch.Generator(device=dev).manual_seed(0)
    gu = torch.randn(e, 2 * i, hd, device=dev, generator=g, dtype=dt) * 0.02
    dn = torch.randn(e, hd, i, device=dev, generator=g, dtype=dt) * 0.02
    qe = qx.QuantExperts.quantize(gu, dn, "nvfp4", lambda y: torch.nn.functional.silu(y[..., :i]) * y[..., i:], dt)
    del gu, dn
    qe.add_lora(a.rank, 2.0 * a.rank)
    qe.to(dev)
    with torch.no_grad():
        for b in qe.lora_B.values():
            b.normal_(0, 0.02, generator=g)
    qe.grouped = True
    h = torch.randn(a.tokens, hd, device=dev, dtype=dt)
    idx = torch.stack([torch.randperm(e, device=dev)[:a.top_k] for _ in range(a.tokens)])
    wts = torch.softmax(torch.randn(a.tokens, a.top_k, device=dev), -1).to(dt)
    per = max(n * k for n, k in qe.shapes.values()) * torch.empty((), dtype=dt).element_size()
    mib16 = -(-16 * per // (1 << 20))  # a budget of 16 experts
    variants = {
        "loop16": (lambda x: qe(x, idx, wts), {}),
        "host16": (lambda x: qe(x, idx, wts), {"moe_expert_chunk_mib": mib16}),
        "host16_sync": (lambda x: qe(x, idx, wts), {"moe_expert_chunk_mib": mib16}),
        "device16": (lambda x: device_forward(qe, x, idx, wts), {}),
        "host_all": (lambda x: qe(x, idx, wts), {"moe_expert_chunk_mib": -(-e * per // (1 << 20))}),
        "all": (lambda x: all_forward(qe, x, idx, wts), {}),
    }
    sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda: None)
    print(f"{torch.cuda.get_device_name(0) if dev.type == 'cuda' else 'CPU'}: experts {e} x (gate_up {2 * i}x{hd}, "
          f"down {hd}x{i}) nvfp4, top-{a.top_k}, {a.tokens} tokens, LoRA r{a.rank}, {dt}")
    ref = None
    for name, (fn, kw) in variants.items():
        patch = mock.patch.object(qx, "_host_chunks", _host_chunks_blocking) if name == "host16_sync" \
            else mock.patch.object(qx, "_host_chunks", _HOST_CHUNKS)
        with settings.use(**kw), patch:
            chunk = qe.chunk_experts(dt)  # 16 at the real sizes; a whole-MiB budget holds more tiny experts

            def once():
                x = h.clone().requires_grad_(True)
                y = fn(x)
                y.float().square().mean().backward()
                return y, x.grad

            y, gx = once()
            sync()
            if ref is None:
                ref = (y.detach().float(), gx.float())
            dy = ((y.detach().float() - ref[0]).abs().max() / ref[0].abs().max()).item()
            dg = ((gx.float() - ref[1]).abs().max() / ref[1].abs().max()).item()
            # no sync between passes, as 48 layers and several micro-batches run one after the other in a step
            sync()
            t0 = time.perf_counter()
            for _ in range(a.iters):
                once()
            host = time.perf_counter() - t0
            sync()
            wall = time.perf_counter() - t0
            with torch.no_grad():  # the logprob pass: forward only
                fn(h)
                sync()
                t1 = time.perf_counter()
                for _ in range(a.iters):
                    fn(h)
                sync()
                fwd = time.perf_counter() - t1
        print(f"{name:>12} ({chunk:3d} a chunk): {1e3 * wall / a.iters:8.1f} ms a forward + backward, host {1e3 * host / a.iters:8.1f} ms "
              f"to enqueue; no-grad forward {1e3 * fwd / a.iters:7.1f} ms; vs loop16: output {dy:.1e}, input grad {dg:.1e}",
              flush=True)
        assert dy < 2e-2 and dg < 5e-2, f"{name} disagrees with loop16"
    return 0


if __name__ == "__main__":
    sys.exit(main())
