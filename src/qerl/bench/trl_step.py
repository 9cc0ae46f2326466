"""The peer baseline: TRL's GRPOTrainer with a PEFT LoRA in bf16, the same step as `bench step`.

    qerl bench trl_step --shape qwen2.5-7b --max-new-tokens 256 [--json F] [--record]

What TRL users run without vLLM: a bf16 model (random weights in the shape), PEFT LoRA on the
same seven linears at the same rank, TRL's transformers `generate` rollouts, its loss. Same
prompts, G, lengths, micro-batch, μ, gradient checkpointing, optimizer and synthetic verifier as
qerl's `bench step`. TRL runs two optimizer steps; the second is timed (the first pays for
warm-up). Rollout time is the time inside `generate`.

--lengths varied: each sample gets the same limit as in qerl's `bench step` (synthetic.varied_length
of (seed, prompt, sample); TRL's rows are each prompt's G samples in turn), and `generate` is made
to sample EOS at it (`EndAtLimits`), so the sample really ends there, as it would by itself: it is
finished and padded, and `generate` returns once the longest sample of the batch has ended (TRL
without vLLM has no continuous batching), and the update pads to the longest completion.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from .record import RESULTS
from .step import add_shape_args, case_name, record_case, report, shape_config

CMD = "qerl bench trl_step"


class EndAtLimits:
    """A transformers logits processor: row r of a `generate` call samples EOS as its limits[r]-th new
    token (all other tokens at -inf), so it ends there like a sample that ended by itself."""

    def __init__(self, limits: torch.Tensor, prompt_width: int, eos_id: int, vocab_size: int):
        self.limits, self.width = limits, prompt_width
        self.eos_only = torch.full((vocab_size,), float("-inf"), device=limits.device)
        self.eos_only[eos_id] = 0.0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        end = (input_ids.shape[1] - self.width + 1 >= self.limits)[:, None]  # this token is the limit-th
        return torch.where(end, self.eos_only[: scores.shape[-1]].to(scores.dtype), scores)


def row_limits(rows: int, G: int, seed: int, max_new_tokens: int) -> list[int]:
    """The limits of a generate call's rows: prompt r // G, sample r % G (TRL repeats each prompt G times)."""
    from .synthetic import varied_length

    return [varied_length(seed, r // G, r % G, max_new_tokens) for r in range(rows)]
TRL_OPTIM = {"adamw_8bit": "adamw_bnb_8bit", "adamw_torch": "adamw_torch"}


def run_case(a) -> dict:
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, TrainerCallback

    from .synthetic import random_prompts, synthetic_tokenizer, synthetic_verifier

    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    optim = TRL_OPTIM[a.optim]
    if optim == "adamw_bnb_8bit":  # as qerl's trainer does: without bitsandbytes, torch AdamW and a notice
        try:
            import bitsandbytes  # noqa: F401
            if not cuda:
                raise ImportError("8-bit AdamW needs CUDA")
        except Exception as e:  # noqa: BLE001
            print(f"trl_step: adamw_8bit unavailable ({type(e).__name__}); using adamw_torch")
            optim = "adamw_torch"
    varied = getattr(a, "lengths", "max") == "varied"
    res = {"case": case_name(a, f"trl{trl.__version__}-peft-bf16"), "shape": a.shape, "quant": "trl-bf16",
           "rows": a.prompts * a.num_generations, "fits": True, "optim": optim,
           "device": torch.cuda.get_device_name(dev) if cuda else "cpu", "lengths": getattr(a, "lengths", "max"),
           "max_new_tokens": a.max_new_tokens}
    if a.memory_cap_gb:
        from ..device_memory import set_memory_cap

        set_memory_cap(a.memory_cap_gb, dev)
    phase = "build"
    try:
        cfg = shape_config(a)
        t0 = time.perf_counter()
        torch.manual_seed(a.seed)
        with torch.device(dev):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if cuda else torch.float32)
        tok = synthetic_tokenizer(cfg.vocab_size)
        model.generation_config.eos_token_id, model.generation_config.pad_token_id = 1, 0
        res["build_s"] = time.perf_counter() - t0
        if cuda:
            res["model_gib"] = torch.cuda.memory_allocated(dev) / 2**30
        n_rows = a.prompts * a.num_generations
        args = trl.GRPOConfig(
            output_dir=str(Path(a.out) / "trl"), per_device_train_batch_size=a.micro_batch,
            gradient_accumulation_steps=n_rows // a.micro_batch, num_generations=a.num_generations,
            max_completion_length=a.max_new_tokens, max_steps=2, learning_rate=1e-5, bf16=cuda,
            gradient_checkpointing=a.gradient_checkpointing, beta=0.0, loss_type="dapo",
            num_iterations=a.num_iterations, temperature=1.0, report_to="none", logging_steps=1,
            save_strategy="no", seed=a.seed, use_cpu=not cuda, optim=optim, shuffle_dataset=False, epsilon_high=0.28,
            dataloader_num_workers=0)
        lora = LoraConfig(r=a.lora_rank, lora_alpha=2 * a.lora_rank, lora_dropout=0.0, task_type="CAUSAL_LM",
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        ds = Dataset.from_list(random_prompts(n_rows * 2, a.prompt_len, cfg.vocab_size, a.seed))
        marks: list[dict] = []
        gen_s = [0.0]

        class Timer(TrainerCallback):
            def on_step_begin(self, *_, **__):
                if cuda:
                    torch.cuda.synchronize(dev)
                    torch.cuda.reset_peak_memory_stats(dev)
                gen_s[0] = 0.0
                marks.append({"t0": time.perf_counter()})

            def on_step_end(self, *_, **__):
                if cuda:
                    torch.cuda.synchronize(dev)
                m = marks[-1]
                m.update(step_s=time.perf_counter() - m["t0"], rollout_s=gen_s[0])
                if cuda:
                    m["peak_allocated_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
                    m["peak_reserved_gib"] = torch.cuda.max_memory_reserved(dev) / 2**30

        phase = "setup"
        tr = trl.GRPOTrainer(model=model, reward_funcs=[synthetic_verifier], args=args, train_dataset=ds,
                             processing_class=tok, peft_config=lora, callbacks=[Timer()])
        gen = tr.model.generate

        def timed_generate(*x, **k):  # TRL calls the unwrapped (PEFT) model's generate
            if varied:
                from transformers import LogitsProcessorList

                ids = k["input_ids"]
                lim = torch.tensor(row_limits(ids.shape[0], a.num_generations, a.seed, a.max_new_tokens),
                                   device=ids.device)
                k["logits_processor"] = LogitsProcessorList([EndAtLimits(lim, ids.shape[1], 1, cfg.vocab_size)])
            if cuda:
                torch.cuda.synchronize(dev)
            t = time.perf_counter()
            out = gen(*x, **k)
            if cuda:
                torch.cuda.synchronize(dev)
            gen_s[0] += time.perf_counter() - t
            return out

        tr.model.generate = timed_generate
        res["trainable_params"] = sum(p.numel() for p in tr.model.parameters() if p.requires_grad)
        phase = "train"
        tr.train()
        m = marks[-1]
        hist = [h for h in tr.state.log_history if "completions/mean_length" in h]
        mean_len = hist[-1]["completions/mean_length"] if hist else float(a.max_new_tokens)
        new_tokens = int(mean_len * n_rows)
        res.update(completion_length_mean=mean_len, completion_length_fraction=mean_len / a.max_new_tokens)
        if hist and "completions/clipped_ratio" in hist[-1]:
            res["truncated_fraction"] = hist[-1]["completions/clipped_ratio"]
        res.update(step_s=m["step_s"], rollout_s=m["rollout_s"] or None, logprob_s=None,
                   update_s=(m["step_s"] - m["rollout_s"]) if m["rollout_s"] else None, new_tokens=new_tokens,
                   warmup_s=marks[0]["step_s"], steps=marks,
                   step_tokens_per_s=(new_tokens + n_rows * a.prompt_len) / m["step_s"],
                   rollout_tokens_per_s=new_tokens / m["rollout_s"] if m["rollout_s"] else None)
        if cuda:
            res.update(peak_allocated_gib=m["peak_allocated_gib"], peak_reserved_gib=m["peak_reserved_gib"])
    except torch.OutOfMemoryError as e:
        res.update(fits=False, oom_phase=phase, error=str(e).splitlines()[0][:400])
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(prog="qerl bench trl_step", description=__doc__.splitlines()[0])
    add_shape_args(ap)
    ap.add_argument("--optim", default="adamw_8bit", choices=sorted(TRL_OPTIM), help="mapped to TRL's optim names")
    a = ap.parse_args(argv)
    res = run_case(a)
    if res["fits"]:
        print(f"== {res['case']} on {res['device']}\n   warm-up step {res['warmup_s']:.1f} s; timed step "
              f"{res['step_s']:.2f} s (generate {res['rollout_s'] or float('nan'):.2f} s), {res['new_tokens']} new "
              f"tokens, peak {res.get('peak_allocated_gib', float('nan')):.2f} GiB allocated\n"
              f"   completions ({res['lengths']} lengths): mean {res['completion_length_mean']:.1f} tokens = "
              f"{100 * res['completion_length_fraction']:.1f}% of {res['max_new_tokens']}")
    else:
        report(res)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=1))
    if a.record:
        command = CMD + " " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
        record_case(res, command, Path(a.results_dir) if a.results_dir else RESULTS)
    return 0 if res["fits"] else 3


if __name__ == "__main__":
    raise SystemExit(main())
