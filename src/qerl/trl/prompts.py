"""Prompt lengths under TRL's API. TRL 1.16 has no prompt limit: a prompt is never cut. qerl's rollout
engine is sized by max_prompt_length, and a prompt over it loses its start (often the system instruction),
so a TRL script gets a limit that holds its longest prompt (training and eval prompts); a limit the script
sets itself is kept, and the trainer says once how many training prompts it cuts (tasks/prompts.py's
PromptCut, as under `qerl train`)."""

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


def prompt_limit(cfg, rows: list[dict], processing_class, set_by_script: int | None) -> int | None:
    """The max_prompt_length to use: one that holds the longest of `rows`' prompts when the script set none
    (None: the config's holds them, or the tokenizer did not load); None when the script set one (kept; the
    trainer counts the prompts it cuts)."""
    if set_by_script is not None:
        return None
    try:
        tok = _tokenizer(cfg, processing_class)
    except Exception:  # noqa: BLE001 - the policy's own loading names the problem
        return None
    from ..tasks.prompts import prompt_cut

    cut = prompt_cut(tok, rows, cfg.max_prompt_length, system_prompt=cfg.system_prompt, suffix=cfg.prompt_suffix)
    return cut.longest if cut.cut else None
