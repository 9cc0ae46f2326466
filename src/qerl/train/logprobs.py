"""Per-token log-probabilities and entropies of completions, computed in chunks.

The model body runs once; the lm_head, log-softmax and entropy run over chunks of completion
tokens, each chunk recomputed in backward (activation checkpointing), so neither the forward
nor the backward ever holds a [batch, length, vocab] fp32 tensor, only one chunk's logits.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ..layers.quant_embed import table_device_dtype


def pad_batch(prompts: list[list[int]], completions: list[list[int]], pad_id: int = 0):
    """Right-padded prompt+completion ids [B, T], attention mask [B, T], the index of the
    hidden state predicting each completion token [B, L] and the completion mask [B, L]."""
    b = len(prompts)
    t = max(len(p) + len(c) for p, c in zip(prompts, completions))
    lc = max(1, max(len(c) for c in completions))
    ids = torch.full((b, t), pad_id, dtype=torch.long)
    att = torch.zeros(b, t, dtype=torch.long)
    pos = torch.zeros(b, lc, dtype=torch.long)
    mask = torch.zeros(b, lc, dtype=torch.bool)
    targets = torch.zeros(b, lc, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        row = p + c
        ids[i, : len(row)] = torch.tensor(row)
        att[i, : len(row)] = 1
        n = len(c)
        pos[i, :n] = torch.arange(len(p) - 1, len(p) - 1 + n)
        mask[i, :n] = True
        targets[i, :n] = torch.tensor(c, dtype=torch.long)
    return ids, att, pos, targets, mask


def _chunk_stats(h, w, targets, inv_temp: float, want_entropy: bool, entropy_grad: bool = True):
    logits = (h @ w.t()).float()
    if inv_temp != 1.0:  # x * 1.0 is x: a pass over [chunk, vocab] (and its backward) saved at temperature 1
        logits = logits * inv_temp
    lse = torch.logsumexp(logits, -1)
    lp = logits.gather(-1, targets[:, None])[:, 0] - lse
    if not want_entropy:
        return lp, torch.zeros_like(lp)
    # a statistic, unless the loss differentiates it: computed without autograd, it saves nothing for the
    # backward, so the checkpoint's recompute stops once the logprob's tensors are back (non-reentrant
    # checkpoints stop early) instead of redoing the softmax and its product over [chunk, vocab]
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        lg, ls = (logits, lse) if entropy_grad else (logits.detach(), lse.detach())
        p = torch.softmax(lg, -1)
        ent = ls - (p * lg).sum(-1)
    return lp, ent


def completion_logprobs(model, ids, att, pos, targets, mask, temperature: float = 1.0, chunk: int = 1024,
                        entropy: bool = True, entropy_grad: bool = False, *, position_ids=None, rows=None):
    """(logprobs [B, L], entropies [B, L]) of `targets` under softmax(logits / temperature);
    zero where mask is False. Logprobs are differentiable when grad is enabled; entropies only with
    entropy_grad (an entropy bonus in the loss), else detached.

    pos [B, L]: the index of the hidden state predicting each target, in row `rows` [B, L] of the
    model's output (default: row b for completion b, as pad_batch lays them out). Packed rows
    (train/packing.py) pass their own position_ids and a prepared 4D mask as `att`."""
    dev = table_device_dtype(model.get_input_embeddings())[0]
    ids, att, pos, targets, mask = (x.to(dev) for x in (ids, att, pos, targets, mask))
    kw = {} if position_ids is None else {"position_ids": position_ids.to(dev), "use_cache": False}
    hidden = model.model(input_ids=ids, attention_mask=att, **kw).last_hidden_state  # [rows, T, D]
    head = model.lm_head
    if getattr(head, "bias", None) is not None:
        raise ValueError("completion_logprobs: an lm_head with a bias is not supported")
    b, lc = pos.shape
    rows = torch.arange(b, device=dev)[:, None].expand(b, lc) if rows is None else rows.to(dev)
    r, p = rows[mask], pos[mask]
    # [N, D] only the real completion positions. Packed rows read one hidden state several times (a
    # prompt's last predicts each completion's first): its gradient adds up, which the CPU's advanced-
    # index backward does with atomics in any order (run-to-run different); index_select's backward
    # adds in index order there. On CUDA it is the reverse (index_add has atomics, __getitem__ sorts).
    h = hidden.flatten(0, 1).index_select(0, r * hidden.shape[1] + p) if dev.type == "cpu" else hidden[r, p]
    tg = targets[mask]
    lps, ents = [], []
    grad = torch.is_grad_enabled()
    for s in range(0, h.shape[0], chunk):
        args = (h[s:s + chunk], head.weight, tg[s:s + chunk], 1.0 / temperature, entropy, entropy_grad)
        lp, en = checkpoint(_chunk_stats, *args, use_reentrant=False) if grad else _chunk_stats(*args)
        lps.append(lp)
        ents.append(en)
    out_lp = torch.zeros(b, lc, device=dev, dtype=torch.float32)
    out_en = torch.zeros(b, lc, device=dev, dtype=torch.float32)
    if lps:
        out_lp = out_lp.masked_scatter(mask, torch.cat(lps))
        en = torch.cat(ents)
        out_en = out_en.masked_scatter(mask, en if entropy_grad else en.detach())
    return out_lp, out_en
