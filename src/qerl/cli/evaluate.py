"""qerl eval MODEL --dataset_name NAME | qerl eval RUN_DIR: held-out pass@1 (averaged over k samples, with its
standard error). A run folder (as `qerl train` writes) is evaluated with its adapter on its own task and
evaluation settings; flags given as well override them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .argtypes import non_negative, positive, unit_interval

HELP = "evaluate a policy (quantized base + optional PEFT adapter), or a training run's folder: pass@1 over k samples"
USAGE = "qerl eval [MODEL | RUN_DIR] [--adapter DIR] [--dataset_name NAME] [options]"
DEFAULTS = dict(adapter=None, quant="auto", dataset="gsm8k-offline", dataset_config="{}", split="eval", limit=None,
                samples=1, temperature=0.6, top_p=0.95, greedy=False, max_new_tokens=512, prompt_suffix=False,
                system_prompt=None, seed=0, device=None)


def add_arguments(p):
    from .vocabulary import add_model_flag

    add_model_flag(p)
    d = DEFAULTS
    p.add_argument("model", nargs="?", default="smollm2",
                   help="a folder, a hub id, smollm2 (offline), or a run folder of `qerl train` (its adapter on its "
                        "task's held-out split with its evaluation settings) (default: smollm2)")
    p.add_argument("--adapter", help="a PEFT LoRA adapter folder (as `qerl train` or PEFT writes) (default: none)")
    p.add_argument("--quant", default=d["quant"], choices=["nvfp4", "mxfp4", "nf4", "bf16", "auto"],
                   help="base format (auto: the one the adapter was trained on, else the checkpoint's, else nvfp4) "
                        "(default: auto)")
    p.add_argument("--dataset", default=d["dataset"],
                   help="gsm8k-offline (no network), rg:<name>, gsm8k, math500, aime24, ..., or a .jsonl/.parquet "
                        "file (default: gsm8k-offline)")
    p.add_argument("--dataset-config", default=d["dataset_config"],
                   help="options as JSON/YAML, e.g. '{question: problem, seed: 1}' (default: {})")
    p.add_argument("--split", choices=["eval", "train"], default=d["split"],
                   help="which part of the task to score (default: eval)")
    p.add_argument("--limit", type=positive, help="the first N problems (default: all)")
    p.add_argument("--samples", "-k", type=positive, default=d["samples"],
                   help="samples per problem; pass@1 is averaged over them (default: 1)")
    p.add_argument("--temperature", type=non_negative, default=d["temperature"], help="0: greedy (default: 0.6)")
    p.add_argument("--top-p", type=unit_interval, default=d["top_p"], help="nucleus sampling (default: 0.95)")
    p.add_argument("--greedy", action="store_true", help="greedy decoding (default: off)")
    p.add_argument("--max-new-tokens", type=positive, default=d["max_new_tokens"],
                   help="new tokens per completion (default: 512)")
    p.add_argument("--prompt-suffix", action="store_true",
                   help="append the paper's <think>/<answer> instruction (default: off)")
    p.add_argument("--system-prompt", help="a system message (default: none)")
    p.add_argument("--seed", type=int, default=d["seed"], help="sampling seed (default: 0)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    p.add_argument("--out", help="JSON report file (default: print the summary only)")
    p.add_argument("--no-text", action="store_true", help="leave questions and completions out of the report")


def is_run_folder(path: str) -> bool:
    p = Path(path)
    return (p / "config.yaml").is_file() and (p / "adapter").is_dir()


def run_settings(args) -> tuple[dict, int | None, int]:
    """A run folder's evaluation as flags: (settings, max_prompt_length, max_turns); flags the user gave
    (other than their defaults) win."""
    from ..rl import GRPOConfig

    run = Path(args.model)
    cfg = GRPOConfig.from_yaml(run / "config.yaml")
    name, opts = (cfg.eval_dataset_name, cfg.eval_dataset_config) if cfg.eval_dataset_name else \
        (cfg.dataset_name, cfg.dataset_config)
    mine = dict(model=cfg.model_name_or_path, adapter=str(run / "adapter"), quant=cfg.quant, dataset=name,
                dataset_config=json.dumps(opts), limit=cfg.eval_limit, samples=cfg.eval_num_samples,
                temperature=cfg.eval_temperature, top_p=cfg.eval_top_p,
                max_new_tokens=cfg.eval_max_completion_length or cfg.max_completion_length,
                prompt_suffix=cfg.prompt_suffix, system_prompt=cfg.system_prompt, seed=cfg.seed,
                device=None if cfg.device == "auto" else cfg.device)
    given = {k for k, v in DEFAULTS.items() if getattr(args, k) != v}
    return {k: (getattr(args, k) if k in given else v) for k, v in mine.items()}, cfg.max_prompt_length, cfg.max_turns


def run(args):
    from .vocabulary import take_model_flag

    take_model_flag(args, "smollm2")

    import yaml

    from ..rl.evaluate import evaluate
    from ..rollout import Engine
    from ..tasks import get_task
    from ..tasks.rewards import format_reward
    from .policy import load_cli_policy

    max_prompt_length, max_turns, run_dir = None, 4, None
    if is_run_folder(args.model):
        run_dir = args.model
        settings, max_prompt_length, max_turns = run_settings(args)
        for k, v in settings.items():
            setattr(args, k, v)
        print(f"qerl eval: run {run_dir}: {args.model} + {args.adapter} on {args.dataset} (its evaluation settings)",
              file=sys.stderr)
    if args.out and Path(args.out).is_dir():  # before the model loads; it left a stray .tmp file after the run
        raise ValueError(f"--out {args.out}: is a folder; the report is a file (e.g. {Path(args.out) / 'report.json'})")
    try:
        opts = yaml.safe_load(args.dataset_config) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"--dataset_config: not valid YAML/JSON ({str(e).splitlines()[0]}): "
                         f"{args.dataset_config!r}") from None
    if not isinstance(opts, dict):
        raise ValueError(f"--dataset_config: expected a mapping, got {args.dataset_config!r}")
    task = get_task(args.dataset, **opts)
    for note in task.notes:  # e.g. rows that on_error: skip left out
        print(f"qerl eval: {args.dataset}: {note}", file=sys.stderr)
    rows = task.eval if args.split == "eval" else task.train
    rows = rows[:args.limit] if args.limit else rows
    if not rows:
        raise ValueError(f"{args.dataset}: the {args.split} split has no problems")
    pol, device = load_cli_policy(args.model, args.quant, args.adapter, args.device, args.max_new_tokens)
    from ..tasks.prompts import encode_prompt
    from .policy import check_length

    longest = max(len(encode_prompt(pol.tokenizer, r["prompt"], system_prompt=args.system_prompt,
                                    suffix=args.prompt_suffix, max_length=max_prompt_length)) for r in rows)
    check_length(getattr(pol.model.config, "max_position_embeddings", None), longest, args.max_new_tokens,
                 f"{args.dataset}: its longest prompt", "--max_completion_length")
    turns_for = None
    if getattr(task, "tools", None) and max_turns:  # a tool task: multi-turn rollouts, as in training
        from ..tools import ToolTurnHandler

        turns_for = lambda part: ToolTurnHandler(pol.tokenizer, part, task.tools, max_turns=max_turns)  # noqa: E731
    eng = Engine(pol.model, pol.tokenizer, max_len=longest + args.max_new_tokens + 1,
                 max_slots=min(256, max(1, len(rows)) * args.samples))
    rep = evaluate(eng, pol.tokenizer, rows, task.accuracy_func(), samples=args.samples, temperature=args.temperature,
                   top_p=args.top_p, greedy=args.greedy, max_new_tokens=args.max_new_tokens, seed=args.seed,
                   system_prompt=args.system_prompt, prompt_suffix=args.prompt_suffix,
                   max_prompt_length=max_prompt_length, turns_for=turns_for,
                   format_func=format_reward if args.prompt_suffix else None, dataset=args.dataset,
                   keep_text=not args.no_text)
    rep.params.update(model=args.model, adapter=args.adapter, quant=args.quant, device=device, split=args.split,
                      run=run_dir)
    print(rep.summary())
    if rep.format_rate is not None:
        print(f"format rate {100 * rep.format_rate:.1f} %; mean length {rep.completion_length_mean:.0f} tokens; "
              f"truncated {100 * rep.truncated_fraction:.1f} %")
    if args.out:
        print(f"report: {rep.write(args.out)}")
    else:
        print(json.dumps({k: getattr(rep, k) for k in ("pass_at_1", "stderr", "problems", "samples")}))
    return 0
