"""A tokenizer, prompts and a verifier for benchmarks on random-weight models.

Random weights produce random token ids over the whole vocabulary, which a real tokenizer of
another vocabulary cannot decode. `synthetic_tokenizer` is a real Hugging Face fast tokenizer
(word-level, one word per id: "t0" ... "tN") over the model's vocabulary size, so every id
decodes and every prompt of n words is exactly n tokens; qerl and TRL both take it as they take
any tokenizer. `synthetic_verifier` is a reward both call with their own reward signature.

Random weights almost never sample EOS, so every completion runs to the length limit: the worst
case. `varied_length` gives each sample its own limit instead (uniform on 5-75 % of the limit,
mean 40 %), which the engine honours (SamplingParams.sample_max_new_tokens) and TRL's generate
is made to honour (trl_step.EndAtLimits): completions that end at varied lengths, as a real run's do.
`char_tokenizer` is one character a token (vocabulary 160): random ids decode to text that stop strings
can be found in (the multi-turn rollout bench).
"""

from __future__ import annotations

import functools
import hashlib
import random

PAD, EOS = "<pad>", "<eos>"


def synthetic_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, EOS: 1, **{f"t{i}": i for i in range(2, vocab_size)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token=PAD))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token=PAD, eos_token=EOS, unk_token=PAD,
                                   padding_side="left")


def char_tokenizer():
    """A character-level fast tokenizer over ids 0-98 (<pad>, <eos>, <unk>, printable ASCII, newline), for a
    model of vocabulary 160: random ids decode to real text, so stop strings are scanned as in a real run."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, EOS: 1, "<unk>": 2}
    for ch in [chr(c) for c in range(32, 127)] + ["\n"]:
        vocab[ch] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token=PAD, eos_token=EOS, unk_token="<unk>")


def random_prompts(n: int, length: int, vocab_size: int, seed: int = 0) -> list[dict]:
    """n rows {"prompt": text of `length` words}, each word one token of the synthetic tokenizer."""
    r = random.Random(seed)
    return [{"prompt": " ".join(f"t{r.randrange(2, vocab_size)}" for _ in range(length))} for _ in range(n)]


def synthetic_verifier(completions, **kwargs) -> list[float]:
    """1 when the completion's last token has an even id, else 0: a verifiable 0/1 reward that a
    random policy gets right half of the time, so groups of G >= 2 are informative."""
    out = []
    for c in completions:
        if isinstance(c, list):  # TRL conversational format
            c = c[-1]["content"] if c else ""
        words = c.split()
        out.append(float(bool(words) and words[-1][1:].isdigit() and int(words[-1][1:]) % 2 == 0))
    return out


VARIED_LO, VARIED_HI = 0.05, 0.75  # each sample's limit: uniform on [5 %, 75 %] of the limit, mean 40 %
VARIED_CASE = "varied lengths (mean 40%)"


def varied_length(seed: int, prompt: int, sample: int, max_new_tokens: int) -> int:
    """Sample `sample` of prompt `prompt`'s length limit: uniform on [5 %, 75 %] of max_new_tokens
    (mean 40 %), at least 1, a pure function of (seed, prompt, sample): the same in any process,
    batch order or data-parallel split, and the same for qerl's engine and the TRL baseline."""
    h = hashlib.blake2b(f"{seed}/{prompt}/{sample}".encode(), digest_size=8).digest()
    u = int.from_bytes(h, "little") / 2**64  # [0, 1)
    return max(1, min(max_new_tokens, round(max_new_tokens * (VARIED_LO + (VARIED_HI - VARIED_LO) * u))))


def varied_limits(seed: int, max_new_tokens: int):
    """(prompt key, sample index) -> that sample's limit: SamplingParams.sample_max_new_tokens."""
    return functools.partial(varied_length, seed, max_new_tokens=max_new_tokens)
