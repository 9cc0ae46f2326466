"""A reference multi-turn rollout: greedy decoding with an HF model, one sample at a time.

Slow and simple on purpose: the oracle for the engine's continuation (same stop rule, the tool's
ids appended to the same KV cache, no re-prefill) and a CPU path for tests. Tool tokens count
toward `max_new_tokens`, as in TRL; a tool answer that would not fit ends the sample instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .calls import tool_call_stop_strings
from .chat import tool_response_ids


@dataclass
class ToolRollout:
    completion_ids: list[int] = field(default_factory=list)  # model and tool tokens after the prompt
    tool_mask: list[int] = field(default_factory=list)  # 1: the model's token (trained on); 0: a tool's (masked)
    tool_calls: int = 0
    tool_turns: int = 0
    finish_reason: str = ""  # eos | length | max_turns | stop (a closing marker with no complete call)


def _eos_ids(model, tokenizer) -> set[int]:
    e = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return ({tokenizer.eos_token_id} | set(e if isinstance(e, list) else [e])) - {None}


def reference_rollout(model, tokenizer, prompt_ids: list[int], env, *, max_new_tokens: int = 256,
                      max_turns: int = 4, turn_prefix: str = "") -> ToolRollout:
    """turn_prefix: assistant text the prompt already ends with (a forced start such as '<tool_call>{...'),
    read as the start of the first turn when looking for calls."""
    import torch

    stop = tool_call_stop_strings(env.fmt)
    eos = _eos_ids(model, tokenizer)
    r, cache, feed, turn_start = ToolRollout(), None, list(prompt_ids), 0
    dev = next(model.parameters()).device
    with torch.no_grad():
        while True:
            out = model(torch.tensor([feed], device=dev), past_key_values=cache, use_cache=True)
            cache, tok = out.past_key_values, int(out.logits[0, -1].argmax())
            r.completion_ids.append(tok)
            r.tool_mask.append(1)
            feed = [tok]
            if tok in eos:
                r.finish_reason = "eos"
                return r
            if len(r.completion_ids) >= max_new_tokens:
                r.finish_reason = "length"
                return r
            turn = (turn_prefix if turn_start == 0 else "") + tokenizer.decode(r.completion_ids[turn_start:],
                                                                               skip_special_tokens=True)
            if not any(s in turn for s in stop):
                continue
            msgs = env.respond(turn)
            if not msgs:
                r.finish_reason = "stop"
                return r
            if r.tool_turns == max_turns:
                r.finish_reason = "max_turns"
                return r
            ids = tool_response_ids(tokenizer, msgs)
            if len(r.completion_ids) + len(ids) >= max_new_tokens:
                r.finish_reason = "length"
                return r
            r.completion_ids += ids
            r.tool_mask += [0] * len(ids)
            r.tool_calls += len(msgs)
            r.tool_turns += 1
            # the call's last token was sampled but never fed: it enters the cache with the tool's ids
            feed, turn_start = [tok] + ids, len(r.completion_ids)
