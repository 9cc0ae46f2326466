"""qerl generate MODEL --prompt TEXT: sample completions from a (quantized, LoRA) policy."""

from __future__ import annotations

import json

from .argtypes import at_least, non_negative, positive, unit_interval

HELP = "sample completions from a policy (quantized base + optional PEFT adapter)"


def add_arguments(p):
    from .vocabulary import add_model_flag

    add_model_flag(p)
    p.add_argument("model", nargs="?", default="smollm2", help="a folder, a hub id, or smollm2 (offline)")
    p.add_argument("--adapter", help="a PEFT LoRA adapter folder (as `qerl train` or PEFT writes)")
    p.add_argument("--quant", default="auto", choices=["nvfp4", "mxfp4", "nf4", "bf16", "auto"],
                   help="base format (auto: the one the adapter was trained on, else the checkpoint's, else nvfp4)")
    p.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    p.add_argument("--n", type=positive, default=1, help="completions per prompt")
    p.add_argument("--temperature", type=non_negative, default=1.0)
    p.add_argument("--top-p", type=unit_interval, default=1.0)
    p.add_argument("--top-k", type=at_least(0), default=0)
    p.add_argument("--max-new-tokens", type=positive, default=256)
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="a string that ends a completion")
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--json", action="store_true", help="one JSON object per completion")


def run(args):
    from .vocabulary import take_model_flag

    take_model_flag(args, "smollm2")
    from ..rollout import Engine, SamplingParams
    from .policy import check_length, load_cli_policy

    pol, device = load_cli_policy(args.model, args.quant, args.adapter, args.device, args.max_new_tokens)
    tok = pol.tokenizer
    prompts = args.prompt
    if tok is not None and not args.no_chat_template and getattr(tok, "chat_template", None):
        prompts = [tok.apply_chat_template([{"role": "user", "content": x}], tokenize=False, add_generation_prompt=True)
                   for x in prompts]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, greedy=args.greedy, stop=args.stop, seed=args.seed)
    ids = [tok(x, add_special_tokens=False)["input_ids"] for x in prompts]
    positions = getattr(pol.model.config, "max_position_embeddings", None)
    for i, x in enumerate(ids):
        check_length(positions, len(x), args.max_new_tokens, f"--prompt {i + 1}", "--max_completion_length")
    eng = Engine(pol.model, tok, max_len=max(len(x) for x in ids) + args.max_new_tokens + 1,
                 max_slots=len(ids) * args.n)
    outs = eng.generate(ids, n=args.n, params=params)
    for c in outs:
        if args.json:
            print(json.dumps({"prompt_index": c.prompt_index, "sample_index": c.sample_index, "text": c.text,
                              "token_ids": c.token_ids, "logprobs": c.logprobs, "finish_reason": c.finish_reason}))
        else:
            print(f"--- prompt {c.prompt_index} sample {c.sample_index} ({len(c.token_ids)} tokens, {c.finish_reason})")
            print(c.text)
    if not args.json:
        s = outs.stats
        print(f"--- {s.new_tokens} tokens in {s.seconds:.2f} s ({s.tokens_per_second:.1f} tok/s) on {device}")
