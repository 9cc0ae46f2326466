"""Token sampling on the device: temperature, top-k, top-p, greedy; no host sync.

On GPUs sampling uses the exponential-race form of the Gumbel trick (argmax p/E, E ~ Exp(1)),
which draws exactly from p and, unlike torch.multinomial, has a fixed-shape, sync-free
implementation that CUDA graphs capture. On the CPU, where nothing is captured, one uniform
draw per row and a search in the cumulative distribution replace the vocabulary-sized
exponential draw (torch.multinomial draws that one too): at a 49k vocabulary and 60 rows,
~95 ms less per decode step on two cores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    greedy: bool = False
    stop: list[str] = field(default_factory=list)  # strings that end a completion (kept in it)
    stop_token_ids: list[int] | None = None  # None: the tokenizer's / generation config's EOS ids
    ignore_eos: bool = False  # benchmarks: always run max_new_tokens
    seed: int | None = None
    # benchmarks: each sample's own limit, to emulate completions that end at varied lengths.
    # (prompt key, sample index) -> that sample's max new tokens (>= 1; capped at max_new_tokens). The
    # prompt key is generate's prompt_keys[i] (default: the prompt's index). The engine really stops the
    # sample there (its slot retires, the batch shrinks), with finish reason "limit" (completion.Completion)
    sample_max_new_tokens: Callable[[int, int], int] | None = None

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.greedy and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (or use greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.sample_max_new_tokens is not None and not callable(self.sample_max_new_tokens):
            raise ValueError("sample_max_new_tokens must be a function (prompt key, sample index) -> tokens")


def processed_logprobs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """fp32 log-probabilities of the distribution actually sampled from (temperature, top-k, top-p)."""
    if p.greedy:
        return torch.log_softmax(logits.float(), -1)
    x = logits.float() / p.temperature
    if p.top_k and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        srt, idx = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(srt, -1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop = (probs.cumsum(-1) - probs) >= p.top_p
        x = x.scatter(-1, idx, srt.masked_fill(drop, float("-inf")))
    return torch.log_softmax(x, -1)


_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) on int64 tensors: values stay below 2^32 and
    the multipliers below 2^31, so no product overflows."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def keyed_uniform(seed: int, keys: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """U(0, 1) in float64, a pure function of (seed, sample key, token position): a sample's draws do
    not depend on which batch, slot or rank it runs in (data-parallel rollouts equal one process's)."""
    # the seed is hashed before it meets the key: seed ^ key alone would give (s, k) and (s ^ d, k ^ d)
    # the same draws, and the trainer's seeds differ by small numbers from round to round
    x = _mix32(_mix32(torch.full_like(keys, seed & _M32)) ^ (keys & _M32))
    x = _mix32(x ^ (pos & _M32))
    return (x.double() + 0.5) / 2**32


def sample(logits: torch.Tensor, p: SamplingParams, generator=None, keyed=None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (token ids [B], their log-probability under the sampled distribution [B]).

    keyed = (seed, keys [B], positions [B]): on the CPU each row's uniform is keyed_uniform's."""
    lp = processed_logprobs(logits, p)
    if p.greedy:
        tok = torch.argmax(lp, -1)
    elif lp.device.type == "cpu":
        cdf = lp.exp().cumsum_(-1)
        if keyed is not None:
            # float32 rounds the top draws to 1.0, where the search would fall past the last token
            u = keyed_uniform(*keyed).to(cdf.dtype).clamp_(max=1 - 2**-24)[:, None] * cdf[:, -1:]
        else:
            u = torch.rand(cdf.shape[0], 1, generator=generator, dtype=cdf.dtype) * cdf[:, -1:]
        tok = torch.searchsorted(cdf, u, right=True)[:, 0].clamp_(max=cdf.shape[-1] - 1)
    else:
        e = torch.empty_like(lp).exponential_(generator=generator)
        tok = torch.argmax(lp - e.log(), -1)  # argmax p/E in log space
    return tok, lp.gather(-1, tok[:, None])[:, 0]
