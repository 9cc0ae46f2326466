"""FP4 E2M1 element codes: rounding, nibble packing, lookup.

Shared by NVFP4 and MXFP4. A code is 4 bits: bit 3 is the sign, bits 0-2 index
the magnitudes below. Two codes share a byte, the first element in the low nibble
(compressed-tensors' and vLLM's layout).
"""

from __future__ import annotations

import torch

E2M1_MAX = 6.0
# Magnitudes of codes 0..7; codes 8..15 are the same values negated.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = torch.tensor(E2M1_MAGNITUDES + tuple(-v for v in E2M1_MAGNITUDES), dtype=torch.float32)

# Round-to-nearest-even on the grid: a midpoint goes to the neighbour whose
# mantissa bit is 0. (threshold, inclusive) pairs: |x| > t, or |x| >= t when the
# tie belongs to the upper neighbour.
_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def round_to_codes(x: torch.Tensor) -> torch.Tensor:
    """Round float values (already divided by their scale) to E2M1 codes, uint8.

    Values beyond ±6 saturate. A negative value that rounds to zero keeps its sign
    (code 0x8), as compressed-tensors writes it.
    """
    a = x.abs()
    idx = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for t, inclusive in _STEPS:
        idx += (a >= t) if inclusive else (a > t)
    # Sign as compressed-tensors derives it (sign(x)·|q|): x < 0, so -0.0 stays +0.
    return idx | ((x < 0).to(torch.uint8) << 3)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """[..., n] uint8 codes -> [..., n/2] bytes, element 2j in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number of FP4 codes ({codes.shape[-1]})")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """[..., n/2] bytes -> [..., n] uint8 codes."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def codes_to_float(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes -> float32 values."""
    return E2M1_VALUES.to(codes.device)[codes.long()]
