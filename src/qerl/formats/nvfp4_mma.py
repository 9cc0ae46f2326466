"""NVFP4 in the order the Hopper small-M kernel consumes (`kernels/w4_mma.py`).

The same bytes as NVFP4 (0.5625 B per weight), permuted once at load so that one
16-byte load per thread holds exactly its `mma.sync.m16n8k16` A-operand fragments
for 64 inputs, and the block scales re-encoded so that a shift and an add turn
them into bf16. Checkpoints never see this layout: `to_checkpoint` gives back the
compressed-tensors bytes, bit for bit.

Weights [N, K] are cut into row tiles of 16 rows (one warp's MMA M) and chunks of
64 inputs. Lane l = 4g + q of a warp holds rows g and g+8 and inputs
[16q, 16q + 16) of the chunk, as four 32-bit words, one per MMA k-step t. Word t
holds the eight codes of the lane's four A registers a_i (i = 0..3, each a pair of
inputs: half h = 0, 1):

    row = g + 8 * (i % 2),  k = 16q + 4t + 2 * (i // 2) + h

The MMA's logical k order differs from the input order (a fixed permutation inside
each 64-input chunk, applied to the activations' fragments identically), which
leaves the dot product unchanged and makes each lane's 16 inputs one scale group.
Both kernels (mma.sync for few tokens, wgmma for many) read these same bytes.

Inside a word the bits sit where the decode wants them (`BITS`): register a_i is
OR_j rotl(word, r_j) & mask_j over its `RECIPE` entries, which puts each code's
sign at bit 15 / 31 and its e e m at bits 8..6 / 24..22 of a bf16 pair (value *
2^-126), then one bf16x2 multiply by the scale. An exhaustive search over bit
placements (no four rotations of the target mask tile a word) found 9 integer
operations a word the fewest with rotations and LOP3 masks: 1 (v & M) + 2 + 2 + 4,
against 19 for the nibble order (v << 4i, then shift-and-mask), which `BITS = 1`
keeps.

Scales: per row tile and chunk, lane l holds 2 bytes (rows g and g+8 of group
4c + q). A positive finite E4M3 scale becomes e5m3 (5 exponent bits, bias 10, no
subnormals): bf16 bits (b << 4) + (236 << 7) are the scale times 2^119, so
code * scale in bf16 is exact and equals the weight times 2^-7.
"""

from __future__ import annotations

import torch

from .base import QuantizationError
from .e2m1 import unpack_codes
from .nvfp4 import NVFP4

ROWS, CHUNK = 16, 64  # row tile (MMA M) and inputs per 16-byte fragment load
SCALE_BIAS = 236  # bf16 exponent bias added to the e5m3 field: scale * 2^119
OUT_SHIFT = 7  # the decoded product is weight * 2^-7; the epilogue multiplies by 2^7 / gs

# The bit order inside a word, read by both kernels' decode (kernels/w4_common.cuh, `BITS`).
# 1: code (i, h) in nibble 4h + 3 - i, decoded as (v << 4i) shift-and-mask (~19 integer ops a word);
# 2: rotations (9 ops a word; the kernels' default once measured on the device).
BITS = 2
_M = 0x81C081C0  # a bf16 pair's sign and e e m bits: 15, 8..6 and 31, 24..22
# Register a_i = OR over (r, mask) of rotl(word, r) & mask.
RECIPE = {1: None, 2: (((0, _M),), ((4, _M),), ((10, _M),), ((6, 0x00400040), (14, 0x81808180)))}


def _bit_sources(bits: int) -> list[list[int]]:
    """src[p][b]: the word bit holding bit b of the code in nibble slot p = 4h + 3 - i."""
    src = [[4 * p + b for b in range(4)] for p in range(8)]
    if bits == 1:
        return src
    for p in range(8):
        i, h = 3 - p % 4, p // 4
        for b in range(4):
            out = 16 * h + (15 if b == 3 else 6 + b)  # sign -> 15; m, e0, e1 -> 6, 7, 8
            (r,) = [r for r, mask in RECIPE[bits][i] if mask >> out & 1]
            src[p][b] = (out - r) % 32
    flat = sorted(x for row in src for x in row)
    assert flat == list(range(32)), "the recipe's rotations must tile the word"
    return src


BIT_SOURCES = {b: _bit_sources(b) for b in (1, 2)}


def _e4m3_to_e5m3() -> tuple[torch.Tensor, torch.Tensor]:
    """(encode [256] int16, -1 for bytes the kernel cannot take; decode [256] uint8)."""
    raw = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)
    enc = torch.full((256,), -1, dtype=torch.int16)
    dec = torch.zeros(256, dtype=torch.uint8)
    for b in range(256):
        v = float(raw[b])
        if not (v > 0 and v == v and v != float("inf")):
            continue  # zero, negative, NaN: refused (see `check_scales`)
        e = int(torch.floor(torch.log2(torch.tensor(v))).item())
        m = v / 2.0**e - 1.0
        e5, m3 = e + 10, int(round(m * 8))
        assert 1 <= e5 <= 31 and 0 <= m3 <= 7 and (1 + m3 / 8) * 2.0**e == v
        code = (e5 << 3) | m3
        enc[b], dec[code] = code, b
    return enc, dec


SCALE_ENCODE, SCALE_DECODE = _e4m3_to_e5m3()


def scale_bits_bf16(encoded: torch.Tensor) -> torch.Tensor:
    """The kernel's scale decode, in torch: e5m3 bytes -> bf16 (scale * 2^119)."""
    return _bf16((encoded.to(torch.int64) << 4) + (SCALE_BIAS << 7))


def code_bits_bf16(word: torch.Tensor, i: int, bits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' weight decode, in torch: 32-bit words -> the (low, high) bf16 pair of register a_i
    (each the E2M1 value times 2^-126)."""
    bits = BITS if bits is None else bits
    w = word.to(torch.int64) & 0xFFFFFFFF
    if bits == 1:
        v = (w << (4 * i)) & 0xFFFFFFFF
        out = (v & 0x80008000) | ((v >> 6) & 0x01C001C0)
    else:
        out = torch.zeros_like(w)
        for r, mask in RECIPE[bits][i]:
            out |= (((w << r) | (w >> (32 - r))) & 0xFFFFFFFF if r else w) & mask
    return _bf16(out & 0xFFFF), _bf16(out >> 16)


def _bf16(bits16: torch.Tensor) -> torch.Tensor:
    return ((bits16 ^ 0x8000) - 0x8000).to(torch.int16).view(torch.bfloat16)  # as signed int16, then bitcast


def place_bits(codes: torch.Tensor, src) -> torch.Tensor:
    """[..., 8] codes in nibble slots -> [..., 4] little-endian bytes of the word, bits placed by `src`."""
    # int32 (bit 31 wraps into the sign, harmless for bit operations): a load-time pass over one layer.
    word = torch.zeros(codes.shape[:-1], dtype=torch.int32, device=codes.device)
    for p in range(8):
        c = codes[..., p].to(torch.int32)
        for b in range(4):
            word |= ((c >> b) & 1) << src[p][b]
    return torch.stack([(word >> (8 * j)) & 0xFF for j in range(4)], -1).to(torch.uint8)


def take_bits(bytes4: torch.Tensor, src) -> torch.Tensor:
    """The inverse of `place_bits`: [..., 4] bytes -> [..., 8] codes (uint8)."""
    b = bytes4.to(torch.int32)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    codes = [sum(((word >> src[p][bit]) & 1) << bit for bit in range(4)) for p in range(8)]
    return torch.stack(codes, -1).to(torch.uint8)


def supports_shape(shape: tuple[int, int]) -> bool:
    n, k = shape
    return n % ROWS == 0 and k % CHUNK == 0 and n > 0 and k > 0


def check_scales(scale: torch.Tensor, name: str) -> None:
    bad = SCALE_ENCODE.to(scale.device)[scale.view(torch.uint8).long()] < 0
    if bool(bad.any()):
        r, c = (int(v) for v in bad.nonzero()[0])
        raise QuantizationError(
            f"{name}: block scale at row {r}, block {c} is {float(scale[r, c].float())}; the MMA layout needs "
            "positive finite scales (the layer keeps the standard layout)")


def _code_view(codes: torch.Tensor, n: int, k: int) -> torch.Tensor:
    # n = ((rt*2 + h8)*8 + g), k = (((c*4 + q)*4 + t)*2 + i2)*2 + hi
    return codes.view(n // ROWS, 2, 8, k // CHUNK, 4, 4, 2, 2)


def repack(packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int], name: str = "weight"):
    """Standard NVFP4 (packed [N, K/2] uint8, scale [N, K/16] e4m3) -> the same shapes in MMA order."""
    n, k = shape
    if not supports_shape(shape):
        raise QuantizationError(f"{name}: shape {list(shape)} does not tile into {ROWS} x {CHUNK} fragments")
    check_scales(scale, name)
    codes = _code_view(unpack_codes(packed), n, k)
    # -> [rt, c, g, q, t, hi, i2, h8]; nibble p = 4*hi + (3 - (h8 + 2*i2)), so i2 and h8 run backwards.
    codes = codes.permute(0, 3, 2, 4, 5, 7, 6, 1).flip(-1, -2).reshape(n, k // 8, 8)
    out_packed = place_bits(codes, BIT_SOURCES[BITS]).reshape(n, k // 2)
    enc = SCALE_ENCODE.to(scale.device)[scale.view(torch.uint8).long()].to(torch.uint8)
    enc = enc.view(n // ROWS, 2, 8, k // CHUNK, 4).permute(0, 3, 2, 4, 1).reshape(n, k // 16)
    return out_packed.contiguous(), enc.contiguous().view(torch.float8_e4m3fn)


def unrepack(packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int]):
    """The inverse of `repack`: standard NVFP4 bytes, bit for bit."""
    n, k = shape
    codes = take_bits(packed.reshape(n, k // 8, 4), BIT_SOURCES[BITS]).reshape(n, k)
    codes = codes.view(n // ROWS, k // CHUNK, 8, 4, 4, 2, 2, 2).flip(-1, -2)
    codes = codes.permute(0, 7, 2, 1, 3, 4, 6, 5).reshape(n, k // 2, 2)
    out_packed = codes[..., 0] | (codes[..., 1] << 4)
    dec = SCALE_DECODE.to(scale.device)[scale.view(torch.uint8).long()]
    dec = dec.view(n // ROWS, k // CHUNK, 8, 4, 2).permute(0, 4, 2, 1, 3).reshape(n, k // 16)
    return out_packed.contiguous(), dec.contiguous().view(torch.float8_e4m3fn)


class NVFP4Mma(NVFP4):
    """NVFP4 whose packed bytes and scales sit in the kernel's fragment order (same shapes, same bytes).

    Only the torch path and checkpoint I/O need the standard order back; they get it from
    `to_checkpoint` (a transient copy of one layer)."""

    layout = "mma"
    row_tile = ROWS

    def to_checkpoint(self, t, shape):
        packed, scale = unrepack(t["weight_packed"], t["weight_scale"], shape)
        return {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": t["weight_global_scale"]}

    def from_checkpoint(self, t, shape, name="weight"):
        packed, scale = repack(t["weight_packed"], t["weight_scale"], shape, name)
        return {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": t["weight_global_scale"]}

    def quantize(self, w, global_scale=None):
        return self.from_checkpoint(super().quantize(w, global_scale), tuple(w.shape))

    def dequantize(self, t, shape, dtype=torch.bfloat16):
        return super().dequantize(self.to_checkpoint(t, shape), shape, dtype)
