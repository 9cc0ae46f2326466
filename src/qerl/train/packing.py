"""Padding-free micro-batches with the prompt once per group (issue 23, "an update that wastes nothing").

The unpacked micro-batch (batch.MicroBatch) right-pads B prompt + completion rows to the longest,
so a group's prompt runs through forward and backward G times and short completions carry padding.
Here each group of a micro-batch is ONE row: its prompt once, then its completions end to end

    row    = prompt | c1[:-1] | c2[:-1] | ... | cG[:-1] | pad
    pos    = 0..P-1 | P..      | P..      | ...                 (each completion continues its prompt)
    attend = causal, and a completion token sees the prompt and its own earlier tokens only

A completion's last token is no input (nothing after it is trained), so a completion of length 1
adds no token to the row: the prompt's last hidden state predicts the first token of EVERY
completion of the group. The per-completion outputs (targets, mask, rollout logprobs, advantages)
keep MicroBatch's [B, L] shapes, rows = completions, so the loss and its normalisations are those
of the unpacked path; only where each completion token's hidden state is read from differs.

One group a row, not several groups sharing a row up to a token budget: on the CPU the mask is
dense (sdpa), so attention costs sum(row length^2) and merging rows would make that grow
quadratically, while a row of G completions already has a length close to its neighbours' (a
sum of G lengths varies less than one length), so little padding is left between rows. For the
same reason a dense row is cut at DENSE_MAX_ROW tokens (long completions: the next row repeats the
prompt). On the GPU, FlexAttention skips the blocks the mask leaves out, so a group stays one row
however long, and the micro-batch is usually one group (the benchmarks' micro-batch = G): no
padding at all.

Micro-batches are the unpacked path's slices (per_device_train_batch_size completions each), so
the losses and their per-micro-batch normalisations are unchanged; a group cut by a slice (a
micro-batch size that is not a multiple of G) becomes one row in each micro-batch, its prompt then
running once per micro-batch. With lora_dropout, a group's prompt tokens draw one dropout mask
(shared by its completions) instead of one per completion: the same expectation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

PROMPT, PAD = -1, -2  # segment ids of a row's shared prompt and of its padding; completions are 0, 1, ...

# the attention implementations a packed mask is built for (transformers' names); others fall back
DENSE = ("sdpa", "eager")
FLEX = "flex_attention"
# A dense mask computes a row's whole T x T scores: past ~1k tokens (SmolLM2's width) that would cost
# more than the prompt copies it saves, so a long group is cut into rows of at most this many tokens
DENSE_MAX_ROW = 1024


@dataclass
class PackedBatch:
    """One micro-batch, each group's prompt and completions in one row (see the module docstring)."""
    input_ids: torch.Tensor         # [R, T]
    position_ids: torch.Tensor      # [R, T] positions restart at P for each completion
    segment: torch.Tensor           # [R, T] PROMPT, the completion's index in its row, or PAD
    attention_mask: Any             # [R, 1, T, T]: bool (sdpa), additive (eager) or a flex BlockMask
    hidden_row: torch.Tensor        # [B, L] the row of the hidden state predicting each completion token
    hidden_index: torch.Tensor      # [B, L] its index in that row
    targets: torch.Tensor           # [B, L]
    mask: torch.Tensor              # [B, L] bool: completion tokens the model sampled (not tool output)
    rollout_logprobs: torch.Tensor  # [B, L]
    advantages: torch.Tensor        # [B]
    truncated: torch.Tensor         # [B] bool

    def model_inputs(self) -> dict:
        """The keyword arguments of logprobs.completion_logprobs."""
        return dict(ids=self.input_ids, att=self.attention_mask, pos=self.hidden_index, targets=self.targets,
                    mask=self.mask, position_ids=self.position_ids, rows=self.hidden_row)


@dataclass
class PackedRows:
    """The layout alone (no attention mask, no training data): what `pack` returns."""
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segment: torch.Tensor
    hidden_row: torch.Tensor
    hidden_index: torch.Tensor
    targets: torch.Tensor
    lengths: torch.Tensor  # [B] completion tokens


def groups_of(prompts: list[list[int]]) -> list[range]:
    """Runs of consecutive completions with the same prompt tokens (a group, or the part of one
    that a micro-batch holds)."""
    runs, start = [], 0
    for i in range(1, len(prompts) + 1):
        if i == len(prompts) or prompts[i] != prompts[start]:
            runs.append(range(start, i))
            start = i
    return runs


def row_plan(prompts: list[list[int]], completions: list[list[int]], max_row: int | None = None) -> list[list[int]]:
    """The completions of each row: a run of one prompt per row, cut into several rows (each with
    the prompt again) where it would pass max_row tokens (a row holds at least one completion)."""
    rows = []
    for run in groups_of(prompts):
        used = None
        for i in run:
            n = len(prompts[i]) + max(0, len(completions[i]) - 1)  # the row's length if it starts here
            if used is None or (max_row is not None and used + n - len(prompts[i]) > max_row):
                rows.append([])
                used = len(prompts[i])
            rows[-1].append(i)
            used += n - len(prompts[i])
    return rows


def pack(prompts: list[list[int]], completions: list[list[int]], pad_id: int = 0, pad_to: int = 1,
         max_row: int | None = None) -> PackedRows:
    """Pack consecutive completions of the same prompt into one row each (row_plan: max_row cuts a
    long one); rows right-padded to a common length, a multiple of pad_to (FlexAttention's blocks;
    fewer compiled shapes)."""
    b = len(completions)
    lc = max(1, max((len(c) for c in completions), default=0))
    hrow = torch.zeros(b, lc, dtype=torch.long)
    hidx = torch.zeros(b, lc, dtype=torch.long)
    targets = torch.zeros(b, lc, dtype=torch.long)
    rows = []
    for r, members in enumerate(row_plan(prompts, completions, max_row)):
        p = prompts[members[0]]
        if not p:
            raise ValueError("pack: an empty prompt (its last token predicts each completion's first)")
        ids, pos, seg = list(p), list(range(len(p))), [PROMPT] * len(p)
        for k, i in enumerate(members):
            c = completions[i]
            n = len(c)
            start = len(ids)  # where c[0] sits in the row, when n > 1
            ids += c[:-1]
            pos += range(len(p), len(p) + n - 1)
            seg += [k] * (n - 1)
            if n:
                hrow[i, :n] = r
                hidx[i, 0] = len(p) - 1  # the prompt's last token predicts every completion's first
                hidx[i, 1:n] = torch.arange(start, start + n - 1)
                targets[i, :n] = torch.tensor(c, dtype=torch.long)
        rows.append((ids, pos, seg))
    t = max(len(ids) for ids, _, _ in rows)
    t = -(-t // pad_to) * pad_to
    R = len(rows)
    input_ids = torch.full((R, t), pad_id, dtype=torch.long)
    position_ids = torch.zeros(R, t, dtype=torch.long)
    segment = torch.full((R, t), PAD, dtype=torch.long)
    for r, (ids, pos, seg) in enumerate(rows):
        input_ids[r, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        position_ids[r, :len(pos)] = torch.tensor(pos, dtype=torch.long)
        segment[r, :len(seg)] = torch.tensor(seg, dtype=torch.long)
    lengths = torch.tensor([len(c) for c in completions], dtype=torch.long)
    return PackedRows(input_ids, position_ids, segment, hrow, hidx, targets, lengths)


def allowed(segment: torch.Tensor) -> torch.Tensor:
    """[R, T, T] bool, query x key: causal, and a key is the row's prompt or the query's own segment
    (padding attends to padding and the prompt, so no query row is empty: sdpa gives NaN on one)."""
    t = segment.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=segment.device).tril()
    sk, sq = segment[:, None, :], segment[:, :, None]
    return causal & ((sk == PROMPT) | (sk == sq))


def attention_mask(segment: torch.Tensor, kind: str, dtype=torch.float32):
    """The [R, 1, T, T] mask transformers passes through untouched (a 4D mask is taken as prepared):
    bool for sdpa, additive for eager, a BlockMask for flex_attention (block-sparse: the masked-out
    blocks of other completions cost nothing, which a dense mask on the GPU would)."""
    if kind == "sdpa":
        return allowed(segment)[:, None]
    if kind == "eager":
        m = torch.zeros(segment.shape[0], 1, segment.shape[1], segment.shape[1], dtype=dtype, device=segment.device)
        return m.masked_fill_(~allowed(segment)[:, None], torch.finfo(dtype).min)
    if kind == FLEX:
        from torch.nn.attention.flex_attention import create_block_mask

        seg = segment

        def mask_mod(b, h, q, kv):
            return (kv <= q) & ((seg[b, kv] == PROMPT) | (seg[b, kv] == seg[b, q]))

        r, t = seg.shape
        return create_block_mask(mask_mod, B=r, H=None, Q_LEN=t, KV_LEN=t, device=seg.device, _compile=True)
    raise ValueError(f"packed attention mask: unsupported attention implementation {kind!r}")


def has_sliding_window(model) -> bool:
    """Sliding-window layers would need a mask of their own (not built here): such models train unpacked
    (transformers then builds each layer's window mask). The family's description says which layers slide
    (Mistral's sliding_window covers every layer, which transformers' has_sliding_layers does not say)."""
    from ..model.family import UnsupportedModelError, family_of_model

    try:
        windows = family_of_model(model).windows(model.config)
    except UnsupportedModelError:
        return True  # not a family qerl describes: assume the worst, train unpacked
    return any(w is not None for w in windows) or bool(getattr(getattr(model, "model", None), "has_sliding_layers", False))


def attention_kind(model) -> str | None:
    """The kind of mask this model's attention takes for packed rows; None when packing is not
    supported (flash-attention kernels take no 4D mask)."""
    kind = getattr(model.config, "_attn_implementation", None)
    return kind if (kind in DENSE or kind == FLEX) and not has_sliding_window(model) else None


def use_flex_attention(model) -> bool:
    """On the GPU, switch the model's attention to FlexAttention (transformers' own implementation),
    which skips the blocks a packed row's mask leaves out. Unpacked calls keep working under it (a
    2D mask becomes a causal BlockMask). The rollout engine has its own attention and is unaffected."""
    if model.config._attn_implementation == FLEX:
        return True
    try:
        model.set_attn_implementation(FLEX)
    except (ValueError, ImportError) as e:  # an old torch or a model class without flex support
        print(f"qerl: packed_update: FlexAttention unavailable ({e})", flush=True)
        return False
    return model.config._attn_implementation == FLEX


def packed_micro_batches(batch, size: int, pad_id: int, device, kind: str, dtype=torch.float32) -> list[PackedBatch]:
    """batch.micro_batches' slices of `size` completions, each packed (kind: attention_kind's answer;
    dtype: the model's, for an additive mask)."""
    from .batch import loss_mask_and_logprobs

    out = []
    for s in range(0, len(batch), size):
        comp = batch.completions[s:s + size]
        flex = kind == FLEX
        rows = pack([c.prompt_ids for c in comp], [c.token_ids for c in comp], pad_id=pad_id,
                    pad_to=128 if flex else 1, max_row=None if flex else DENSE_MAX_ROW)
        full = torch.arange(rows.targets.shape[1])[None, :] < rows.lengths[:, None]
        mask, rl = loss_mask_and_logprobs(comp, full)
        seg = rows.segment.to(device)
        out.append(PackedBatch(rows.input_ids, rows.position_ids, seg, attention_mask(seg, kind, dtype),
                               rows.hidden_row, rows.hidden_index, rows.targets, mask, rl.to(device),
                               batch.advantages[s:s + size], batch.truncated[s:s + size]))
    return out
