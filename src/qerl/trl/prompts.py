"""Prompt lengths under TRL's API. TRL 1.16 has no prompt limit: a prompt is never cut. qerl's rollout
engine is sized by max_prompt_length, and a prompt over it loses its start (often the system instruction),
so a TRL script gets a limit that holds its longest prompt; a limit the script sets itself is kept, and
the prompts over it are counted in one line with the longest length."""

from __future__ import annotations

from pathlib import Path


def _tokenizer(cfg, processing_class):
    if processing_class is not None:
        return processing_class
    from transformers import AutoTokenizer

    folder = Path(cfg.model_name_or_path)
    if not (folder / "tokenizer_config.json").is_file():  # a hub id or alias; an adapter folder has its own
        from ..model.resolve import resolve_model

        folder = resolve_model(cfg.model_name_or_path)
    return AutoTokenizer.from_pretrained(folder)


def prompt_lengths(cfg, rows: list[dict], tok) -> list[int]:
    from ..tasks.prompts import encode_prompt

    return [len(encode_prompt(tok, r["prompt"], system_prompt=cfg.system_prompt, suffix=cfg.prompt_suffix))
            for r in rows]


def prompt_limit(cfg, rows: list[dict], processing_class, set_by_script: int | None) -> int | None:
    """The max_prompt_length to use (None: keep the config's), after saying once what a set limit cuts."""
    try:
        tok = _tokenizer(cfg, processing_class)
    except Exception:  # noqa: BLE001 - the policy's own loading names the problem
        return None
    lengths = prompt_lengths(cfg, rows, tok)
    if not lengths:
        return None
    longest = max(lengths)
    if set_by_script is None:
        return max(longest, cfg.max_prompt_length) if longest > cfg.max_prompt_length else None
    over = sum(n > set_by_script for n in lengths)
    if over:
        print(f"qerl: {over} of {len(lengths)} prompts are longer than max_prompt_length={set_by_script} tokens "
              f"(longest {longest}): they are left-cut, losing their start (a system instruction); "
              f"max_prompt_length={longest} keeps them whole, as TRL 1.16 (no prompt limit) does", flush=True)
    return None
