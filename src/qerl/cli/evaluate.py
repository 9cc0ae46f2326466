"""qerl eval MODEL --dataset NAME: held-out pass@1 (averaged over k samples, with its standard error)."""

from __future__ import annotations

import json
import sys

from .argtypes import non_negative, positive, unit_interval

HELP = "evaluate a policy (quantized base + optional PEFT adapter) on a dataset: pass@1 over k samples"


def add_arguments(p):
    p.add_argument("model", nargs="?", default="smollm2", help="a folder, a hub id, or smollm2 (offline)")
    p.add_argument("--adapter", help="a PEFT LoRA adapter folder (as `qerl train` or PEFT writes)")
    p.add_argument("--quant", default="auto", choices=["nvfp4", "mxfp4", "nf4", "bf16", "auto"],
                   help="base format (auto: the one the adapter was trained on, else the checkpoint's, else nvfp4)")
    p.add_argument("--dataset", default="gsm8k-offline",
                   help="gsm8k-offline (default, no network), rg:<name>, gsm8k, math500, aime24, ..., or a .jsonl/.parquet file")
    p.add_argument("--dataset-config", default="{}", help="options as JSON/YAML, e.g. '{question: problem, seed: 1}'")
    p.add_argument("--split", choices=["eval", "train"], default="eval", help="which part of the task to score")
    p.add_argument("--limit", type=positive, help="the first N problems (default: all)")
    p.add_argument("--samples", "-k", type=positive, default=1, help="samples per problem (pass@1 is averaged over them)")
    p.add_argument("--temperature", type=non_negative, default=0.6)
    p.add_argument("--top-p", type=unit_interval, default=0.95)
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--max-new-tokens", type=positive, default=512)
    p.add_argument("--prompt-suffix", action="store_true", help="append the paper's <think>/<answer> instruction")
    p.add_argument("--system-prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--out", help="JSON report path (default: print the summary only)")
    p.add_argument("--no-text", action="store_true", help="leave questions and completions out of the report")


def run(args):
    import yaml

    from ..rl.evaluate import evaluate
    from ..rollout import Engine
    from ..tasks import get_task
    from ..tasks.rewards import format_reward
    from .policy import load_cli_policy

    try:
        opts = yaml.safe_load(args.dataset_config) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"--dataset-config: not valid YAML/JSON ({str(e).splitlines()[0]}): {args.dataset_config!r}") from None
    if not isinstance(opts, dict):
        raise ValueError(f"--dataset-config: expected a mapping, got {args.dataset_config!r}")
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
                                    suffix=args.prompt_suffix)) for r in rows) if rows else 1
    check_length(getattr(pol.model.config, "max_position_embeddings", None), longest, args.max_new_tokens,
                 f"{args.dataset}: its longest prompt", "--max-new-tokens")
    eng = Engine(pol.model, pol.tokenizer, max_len=longest + args.max_new_tokens + 1,
                 max_slots=min(256, max(1, len(rows)) * args.samples))
    rep = evaluate(eng, pol.tokenizer, rows, task.accuracy_func(), samples=args.samples, temperature=args.temperature,
                   top_p=args.top_p, greedy=args.greedy, max_new_tokens=args.max_new_tokens, seed=args.seed,
                   system_prompt=args.system_prompt, prompt_suffix=args.prompt_suffix,
                   format_func=format_reward if args.prompt_suffix else None, dataset=args.dataset,
                   keep_text=not args.no_text)
    rep.params.update(model=args.model, adapter=args.adapter, quant=args.quant, device=device, split=args.split)
    print(rep.summary())
    if rep.format_rate is not None:
        print(f"format rate {100 * rep.format_rate:.1f} %; mean length {rep.completion_length_mean:.0f} tokens; "
              f"truncated {100 * rep.truncated_fraction:.1f} %")
    if args.out:
        print(f"report: {rep.write(args.out)}")
    else:
        print(json.dumps({k: getattr(rep, k) for k in ("pass_at_1", "stderr", "problems", "samples")}))
    return 0
