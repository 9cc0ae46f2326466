"""Prompt text -> token ids through the tokenizer's own chat template, cut to max_prompt_length from the
start (the question, at the end, stays); how many prompts a limit cuts, said in one line."""

from __future__ import annotations

from dataclasses import dataclass

# The paper's prompt suffix (asks for reasoning in <think> and the result in <answer>).
PAPER_SUFFIX = ("\nPlease reason step by step inside <think> </think> tags, then give the final answer "
                "inside <answer> </answer> tags.")


def encode_prompt(tok, prompt, *, system_prompt: str | None = None, suffix: bool = False,
                  max_length: int | None = None) -> list[int]:
    """Chat messages (a list of {"role", "content"}) go through the chat template with a generation
    prompt; a plain string is tokenized as is. Long prompts keep their end (the question)."""
    if isinstance(prompt, list):
        msgs = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [dict(m) for m in prompt]
        if suffix:
            msgs[-1]["content"] = msgs[-1]["content"] + PAPER_SUFFIX
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            ids = tok(text, add_special_tokens=False)["input_ids"]
        else:  # a base model without a template: the messages' text, one per line
            ids = tok("\n".join(m["content"] for m in msgs) + "\n")["input_ids"]
    else:
        ids = tok((prompt + PAPER_SUFFIX) if suffix else prompt)["input_ids"]
    return ids[-max_length:] if max_length else ids


@dataclass(frozen=True)
class PromptCut:
    """What a run's max_prompt_length does to its prompts: `cut` of `total` are longer than `limit`."""
    cut: int
    total: int
    longest: int
    limit: int

    def line(self) -> str:
        return (f"qerl: {self.cut} of {self.total} training prompts are longer than max_prompt_length={self.limit} "
                f"tokens (longest {self.longest}): each is cut to its last {self.limit} tokens, losing its start "
                f"(often an instruction); max_prompt_length={self.longest} keeps them whole")


def prompt_cut(tok, rows, limit: int, *, system_prompt: str | None = None, suffix: bool = False) -> PromptCut:
    """How many of `rows`' prompts, encoded as the rollouts encode them, `limit` cuts (one pass at start-up)."""
    lengths = [len(encode_prompt(tok, r["prompt"], system_prompt=system_prompt, suffix=suffix)) for r in rows]
    return PromptCut(sum(n > limit for n in lengths), len(lengths), max(lengths, default=0), limit)
