"""NF4 in bitsandbytes' layout (the QLoRA baseline).

Blocks of 64 over the flattened weight, an f32 absmax per block, each value the
nearest of 16 normal-float codes of x/absmax; the first element of a pair goes to
the high nibble; storage uint8 [numel/2, 1]. With double quantization the absmax
vector (minus its mean) is itself quantized blockwise (256) to 8 bits with
bitsandbytes' dynamic map. Written by hand so that qerl does not need
bitsandbytes (a CUDA-first package) at run time; tests compare bit for bit.
"""

from __future__ import annotations

import functools

import torch

from .base import WeightFormat

NF4_CODE = torch.tensor(
    [
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
        -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
        0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
        0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
    ],
    dtype=torch.float32,
)  # fmt: skip
DQ_BLOCK = 256


@functools.cache
def dynamic_map() -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic code (create_dynamic_map(signed=True)), sorted."""
    data: list[float] = []
    max_exp, non_sign = 7, 7
    for i in range(max_exp):
        n = 2 ** (i + non_sign - max_exp) + 1
        b = torch.linspace(0.1, 1, n, dtype=torch.float32)
        means = (b[:-1] + b[1:]) / 2.0  # products in f32, as bitsandbytes forms them
        data += ((10 ** (-(max_exp - 1) + i)) * means).tolist()
        data += (-(10 ** (-(max_exp - 1) + i)) * means).tolist()
    data += [0.0, 1.0]
    data += [0.0] * (256 - len(data))
    return torch.tensor(data, dtype=torch.float32).sort().values


def _blockwise(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat f32 -> (x/absmax clamped to [-1, 1], absmax), with a ragged last block."""
    n = x.numel()
    full = n - n % block
    absmax = x[:full].view(-1, block).abs().amax(-1)
    scaled = torch.clamp(x[:full].view(-1, block) * (1.0 / absmax.clamp(min=1e-38)).unsqueeze(-1), -1, 1).reshape(-1)
    if full < n:
        am = x[full:].abs().amax().clamp(min=1e-38)
        absmax = torch.cat([absmax, am.reshape(1)])
        scaled = torch.cat([scaled, torch.clamp(x[full:] / am, -1, 1)])
    return scaled, absmax


def _nearest(scaled: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    mid = (code[:-1] + code[1:]) / 2  # a value on a midpoint goes to the lower code
    return torch.bucketize(scaled, mid.to(scaled.device), out_int32=True).to(torch.uint8)


def _expand(v: torch.Tensor, n: int, block: int) -> torch.Tensor:
    return v.repeat_interleave(block)[:n]


class NF4(WeightFormat):
    name = "nf4"
    block_size = 64

    def __init__(self, double_quant: bool = True):
        self.double_quant = double_quant

    def quantize(self, w, global_scale=None):
        flat = w.detach().reshape(-1).to(torch.float32)
        scaled, absmax = _blockwise(flat, self.block_size)
        q = _nearest(scaled, NF4_CODE)
        t = {"weight": ((q[0::2] << 4) | q[1::2]).unsqueeze(1)}
        if not self.double_quant:
            t["weight_absmax"] = absmax
            return t
        offset = absmax.mean()
        s2, absmax2 = _blockwise(absmax - offset, DQ_BLOCK)
        t["weight_absmax"] = _nearest(s2, dynamic_map())
        t["weight_nested_absmax"] = absmax2
        t["weight_offset"] = offset.reshape(1)
        return t

    def absmax(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        if "weight_nested_absmax" not in t:
            return t["weight_absmax"]
        a = t["weight_absmax"]
        code = dynamic_map().to(a.device)
        return code[a.long()] * _expand(t["weight_nested_absmax"], a.numel(), DQ_BLOCK) + t["weight_offset"]

    def dequantize(self, t, shape, dtype=torch.bfloat16):
        p = t["weight"].reshape(-1)
        q = torch.stack((p >> 4, p & 0x0F), dim=-1).reshape(-1)
        n = shape[0] * shape[1]
        vals = NF4_CODE.to(p.device)[q[:n].long()]
        return (vals * _expand(self.absmax(t), n, self.block_size)).reshape(shape).to(dtype)

    def expected_shapes(self, shape):
        n = shape[0] * shape[1]
        nb = -(-n // self.block_size)
        s = {"weight": (((n + 1) // 2, 1), torch.uint8)}
        if not self.double_quant:
            s["weight_absmax"] = ((nb,), torch.float32)
        else:
            s["weight_absmax"] = ((nb,), torch.uint8)
            s["weight_nested_absmax"] = ((-(-nb // DQ_BLOCK),), torch.float32)
            s["weight_offset"] = ((1,), torch.float32)
        return s
