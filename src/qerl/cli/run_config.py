"""The run's config from the command line, one way for `qerl train` and `qerl sft`: CONFIG.yaml (optional,
first) with --field value pairs on top, or `--resume DIR`: the run's record (DIR/config.yaml) with the
command line's values. Each command builds its own config class from these (cli/train.py, cli/sft.py)."""

from __future__ import annotations

import dataclasses
import os
import shlex
from pathlib import Path

KINDS = {"train": "a GRPO", "sft": "an SFT"}  # the command that writes a run folder -> what its run is


def parse_overrides(tokens: list[str]) -> dict[str, str]:
    out, i = {}, 0
    while i < len(tokens):
        t = tokens[i]
        if not t.startswith("--"):
            raise ValueError(f"expected --field value, got {t!r}")
        key = t[2:].replace("-", "_")
        if "=" in key:
            key, val = key.split("=", 1)
            i += 1
        elif i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            val = tokens[i + 1]
            i += 2
        else:  # a bare flag: a boolean set to true
            val = "true"
            i += 1
        out[key] = val
    return out


def command_line(args, flags: dict[str, str]) -> tuple[str | None, dict[str, str]]:
    """(CONFIG.yaml or None, the values to apply): the fields argparse took (flags), then the --field pairs it
    did not (a misspelt field: the config class says "did you mean")."""
    tokens = list(args.overrides or [])
    config = tokens.pop(0) if tokens and not tokens[0].startswith("--") else None
    return config, {**flags, **parse_overrides(tokens)}


def refuse_allow_changed(args) -> None:
    """--allow_changed belongs to --resume: a new run takes any value."""
    if getattr(args, "allow_changed", None):
        raise ValueError("--allow_changed: only with --resume (a new run takes any value)")


def config_file(config) -> dict:
    """CONFIG.yaml's mapping; a file that is missing or not UTF-8 said by name and line."""
    if not Path(config).is_file():
        raise FileNotFoundError(f"config file {config} not found")
    from ..sft.data import read_utf8

    read_utf8(config, "config file")  # not UTF-8: the file and line, not a bare codec error
    from ..train.fields import yaml_mapping

    return yaml_mapping(config)


def resumed_config(args, config, ov: dict, cls, command: str, apply_ov):
    """`--resume DIR`: the run's record (DIR/config.yaml, DIR/run_record.json) with the command line's values;
    a changed value that defines the run refused unless --allow_changed names it, any other said in one line.
    Returns (config, RunRecord). `qerl train` and `qerl sft` alike."""
    from ..invocation import qerl_command
    from ..train import run_folder
    from ..train.paths import expand, normalise, relative_paths, same_path

    folder = expand(args.resume)
    saved = Path(folder) / "config.yaml"
    if config is not None:  # was ignored without a word
        raise ValueError(f"--resume {args.resume} continues the run on its own record ({saved}); {config} is not "
                         f"read: drop it, or start a new run from it with another --output_dir")
    if not saved.exists():
        raise FileNotFoundError(f"{saved}: not found (is {args.resume} a qerl {'sft ' if command == 'sft' else ''}"
                                "run directory?)")
    check_run_kind(folder, command)  # the other command's run: its command continues it
    recorded = cls.from_yaml(saved)
    if "output_dir" in ov and not same_path(ov["output_dir"], folder):
        raise ValueError(f"--resume {args.resume} continues the run in {folder}; --output_dir {ov['output_dir']} names "
                         f"another folder: drop it, or start a new run there ({qerl_command()} {command} ... "
                         f"--output_dir {shlex.quote(str(ov['output_dir']))})")
    for name, value in relative_paths(recorded).items():
        if name != "output_dir" and main_rank():
            print(f"qerl {command}: {saved} records {name} {value!r} relative to the folder that run started in (an "
                  f"older qerl wrote it); reading it from the current folder: {expand(value)}", flush=True)
    recorded = normalise(dataclasses.replace(recorded, output_dir=folder))
    cfg = normalise(apply_ov(recorded, {**ov, "output_dir": folder}))
    allowed = run_folder.allowed_fields(getattr(args, "allow_changed", None), cls)
    changes = run_folder.check_resume(recorded, cfg, allowed, args.resume, command)
    if (line := run_folder.changes_line(changes, args.resume, command)) and main_rank():
        print(line, flush=True)
    return cfg, run_folder.read_record(folder)


def main_rank() -> bool:
    return os.environ.get("RANK", "0") == "0"


def run_kind(folder) -> str | None:
    """"train" or "sft": the command whose config the run folder's config.yaml is, by its fields (each
    writes every field of its own config); None when it is neither's or cannot be read."""
    from ..rl.config import GRPOConfig
    from ..sft.config import SFTConfig
    from ..train.fields import yaml_mapping
    from ..train.trl_fields import IN_MEMORY

    try:  # qerl.trl's note of in-memory objects is no field of either config
        keys = set(yaml_mapping(Path(folder) / "config.yaml")) - {IN_MEMORY}
    except (OSError, ValueError):
        return None
    fits = [k for k, cls in (("train", GRPOConfig), ("sft", SFTConfig))
            if keys <= {f.name for f in dataclasses.fields(cls)}]
    return fits[0] if len(fits) == 1 else None


def check_run_kind(folder, command: str) -> None:
    """`qerl sft --resume` of a GRPO run (or `qerl train --resume` of an SFT run): said as what the folder
    holds and the command that continues it, not as the other config's first unknown field."""
    from ..invocation import qerl_command
    from ..train.run_folder import RunFolderError

    kind = run_kind(folder)
    if kind is not None and kind != command:
        raise RunFolderError(f"{folder} holds {KINDS[kind]} run of `qerl {kind}`, not a `qerl {command}` run; "
                             f"continue it with: {qerl_command()} {kind} --resume {shlex.quote(str(folder))}")


def check_resume_steps(cfg, command: str = "train", last: int | None = None) -> None:
    """`--resume D --max_steps 6` on a run at step 24 rewrote its adapter and exited 0 with no word:
    refused before the model loads, saying how to train further (`qerl train` and `qerl sft` alike). last: the
    run's last step in the numbering of its checkpoint-N names (cli/train.last_step; cfg.max_steps unless said)."""
    from ..train.checkpoints import checkpoints
    from .stopped_run import resume_command

    found = checkpoints(cfg.output_dir)
    at = int(found[-1].name.rpartition("-")[2]) if found else 0
    last = cfg.max_steps if last is None else last
    if at > last:
        raise ValueError(f"{cfg.output_dir} is at step {at}; max_steps {last} is below it, so there is "
                         f"nothing to train (the run is left as it is). To train further: "
                         f"{resume_command(cfg, command)} --max_steps N (N > {at})")
