"""The QeRL training loop (paper.md, Algorithm 1): GRPO / DAPO on a quantized LoRA policy with AQN.

One step: take prompts -> G rollouts each from the noisy behaviour policy (the engine runs on the
trainer's own modules) -> rewards -> group-relative advantages (DAPO: drop all-equal groups and
sample more) -> num_iterations passes of clipped policy-gradient updates over minibatches ->
metrics -> checkpoint. The KL reference, when beta > 0, is the same model with adapters off.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..layers import QLoRALinear, unfused_lora
from ..rollout import Engine, SamplingParams
from . import run_folder
from . import state as ckpt
from .advantages import group_advantages, informative_groups, overlong_penalty
from .aqn import AQN, sigma_at
from .config import GRPOConfig
from .distributed import Dist
from .logprobs import completion_logprobs, pad_batch
from .loss import policy_loss
from .metrics import MetricsLog
from .rewards import score

from ..tasks.prompts import PAPER_SUFFIX, encode_prompt  # noqa: F401 - PAPER_SUFFIX re-exported


class TrainingError(RuntimeError):
    pass


class PromptSampler:
    """Seeded epoch-wise shuffled order over the training rows; its position is checkpointed."""

    def __init__(self, n: int, seed: int, epoch: int = 0, pos: int = 0):
        if n == 0:
            raise ValueError("the training set is empty")
        self.n, self.seed, self.epoch, self.pos = n, seed, epoch, pos
        self._perm()

    def _perm(self):
        self.order = list(range(self.n))
        random.Random(self.seed * 7919 + self.epoch).shuffle(self.order)

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.pos >= self.n:
                self.epoch, self.pos = self.epoch + 1, 0
                self._perm()
            out.append(self.order[self.pos])
            self.pos += 1
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}


def _lr_lambda(cfg: GRPOConfig, total: int):
    def f(u: int) -> float:
        if u < cfg.warmup_steps:
            return (u + 1) / cfg.warmup_steps
        t = (u - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
        if cfg.lr_scheduler_type == "linear":
            return max(0.0, 1 - t)
        if cfg.lr_scheduler_type == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(1.0, t)))
        return 1.0

    return f


def make_optimizer(cfg: GRPOConfig, params, device: torch.device):
    kw = dict(lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon,
              weight_decay=cfg.weight_decay)
    if cfg.optim == "adamw_8bit":
        if device.type == "cuda":
            try:
                import bitsandbytes as bnb

                return bnb.optim.AdamW8bit(params, **kw), "adamw_8bit (bitsandbytes)"
            except Exception as e:  # noqa: BLE001
                why = f"bitsandbytes unavailable ({type(e).__name__})"
        else:
            why = "8-bit AdamW needs CUDA"
        print(f"qerl: optim adamw_8bit: {why}; using torch AdamW (fp32 states)")
    return torch.optim.AdamW(params, **kw), "adamw_torch"


def _resolve_device_dtype(cfg: GRPOConfig):
    dev = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                       ("cpu" if cfg.device == "auto" else cfg.device))
    if cfg.dtype == "auto":
        dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    else:
        dt = getattr(torch, cfg.dtype)
    return dev, dt


class GRPOTrainer:
    """`GRPOTrainer(config).train()`; or pass a built `policy`, a `task` (train/eval rows and
    reward functions), or `reward_funcs` + `train_dataset` as in TRL."""

    def __init__(self, config: GRPOConfig | None = None, *, policy=None, task=None, reward_funcs=None,
                 train_dataset=None, eval_dataset=None, progress: bool = True):
        self.cfg = cfg = config or GRPOConfig()
        random.seed(cfg.seed)  # dropout and anything else on the global generators (resume restores them)
        torch.manual_seed(cfg.seed)
        self.device, self.dtype = _resolve_device_dtype(cfg)
        self.dist = Dist.from_env(self.device.type, cfg.ddp_timeout, cfg.ddp_backend)
        if self.dist.world > 1:
            if self.device.type == "cuda":
                self.device = torch.device("cuda", self.dist.local_rank)
            W, P = self.dist.world, cfg.generation_batch_size // cfg.num_generations
            if P % W or (cfg.generation_batch_size // W) % (cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps):
                raise ValueError(f"config field 'generation_batch_size': {cfg.generation_batch_size} completions "
                                 f"({P} prompts) must split over {W} ranks into whole prompts and whole updates of "
                                 f"per_device_train_batch_size x gradient_accumulation_steps")
        if policy is None:
            from ..model import load_policy

            policy = load_policy(cfg.model_name_or_path, cfg.quant, lora_rank=cfg.lora_r, lora_alpha=cfg.lora_alpha,
                                 lora_dropout=cfg.lora_dropout, target_modules=cfg.lora_target_modules,
                                 device=self.device, dtype=self.dtype, trust_remote_code=cfg.trust_remote_code,
                                 progress=progress)
        self.policy, self.model, self.tok = policy, policy.model, policy.tokenizer
        if self.tok is None:
            raise ValueError("the policy has no tokenizer: rewards need completion text")
        if task is None and train_dataset is None:
            from ..tasks import get_task

            task = get_task(cfg.dataset_name, **cfg.dataset_config)
        self.train_rows = list(train_dataset) if train_dataset is not None else task.train
        self.reward_funcs = list(reward_funcs) if reward_funcs is not None else task.reward_funcs
        self.reward_weights = cfg.reward_weights if cfg.reward_weights is not None else \
            (getattr(task, "reward_weights", None) if reward_funcs is None else None)
        self.task = task
        self._eval_rows = list(eval_dataset) if eval_dataset is not None else None
        self.evals: list[dict] = []  # one summary per evaluation of this run
        if not self.reward_funcs:
            raise ValueError("no reward functions: pass reward_funcs or a task that has them")
        self.progress = progress
        for i, r in enumerate(self.train_rows[:1]):
            if "prompt" not in r:
                raise ValueError(f"training row {i} has no 'prompt' field (fields: {sorted(r)})")
        if cfg.train_norms:
            for n, p in self.model.named_parameters():
                if n.endswith("norm.weight") and ".layers." in n:
                    p.requires_grad_(True)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("nothing to train: the policy has no LoRA (lora_r = 0) and train_norms is off")
        self.dist.broadcast_(self.params)  # every rank starts from rank 0's adapter
        if cfg.gradient_checkpointing:
            kw = {"use_reentrant": False}
            if hasattr(self.model, "activation_checkpointing_enable"):  # transformers >= 5.2x; the old name warns
                self.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
        self.engine = Engine(self.model, self.tok, max_len=cfg.max_prompt_length + 1 +
                             max(cfg.max_completion_length, cfg.eval_max_completion_length or 0),
                             max_slots=max(cfg.generation_batch_size // self.dist.world, min(256, self._eval_slots())),
                             kv_cache_gb=cfg.rollout_kv_cache_gb if cfg.rollout_kv_cache_gb is not None else
                             (None if self.device.type == "cuda" else 2.0))
        self.optimizer, self.optim_name = make_optimizer(cfg, self.params, self.device)
        self._updates_per_step = max(1, cfg.updates_per_step // self.dist.world)  # on each rank
        total_updates = cfg.max_steps * self._updates_per_step
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(cfg, total_updates))
        self.aqn = AQN(self.model) if cfg.aqn else None
        self.sampler = PromptSampler(len(self.train_rows), cfg.seed)
        self.step = 0
        self.out = Path(cfg.output_dir)
        self._resumed_from = None
        self._lock = run_folder.RunLock(self.out) if self.dist.is_main else None
        self._claimed = False  # the run folder checked (fresh or resumed) by this trainer

    # ---- prompts ---------------------------------------------------------------------------
    def encode_prompt(self, row) -> list[int]:
        return encode_prompt(self.tok, row["prompt"], system_prompt=self.cfg.system_prompt,
                             suffix=self.cfg.prompt_suffix, max_length=self.cfg.max_prompt_length)

    # ---- one step --------------------------------------------------------------------------
    def _noise(self, sigma: float, seed: int):
        return self.aqn.applied(sigma, seed) if self.aqn is not None and sigma > 0 else contextlib.nullcontext()

    def _rollout_round(self, rows_idx, sigma, seed, key_offset: int = 0):
        """Roll out this rank's prompts. The AQN noise uses `seed` on every rank (all ranks perturb
        the same policy); samples are keyed by their index in the global batch on the CPU (the same
        tokens in any split over ranks), and on CUDA come from a per-rank generator stream."""
        cfg = self.cfg
        rows = [self.train_rows[i] for i in rows_idx]
        prompts = [self.encode_prompt(r) for r in rows]
        rseed = seed if self.device.type != "cuda" else seed + 7919 * self.dist.rank
        params = SamplingParams(max_new_tokens=cfg.max_completion_length, temperature=cfg.temperature,
                                top_p=cfg.top_p, top_k=cfg.top_k, seed=rseed)
        outs = self.engine.generate(prompts, n=cfg.num_generations, params=params, perturb=self._noise(sigma, seed),
                                    prompt_keys=[key_offset + i for i in range(len(prompts))])
        texts = [self.tok.decode(c.token_ids, skip_special_tokens=True) for c in outs]
        G = cfg.num_generations
        cols = {k: [r[k] for r in rows for _ in range(G)] for k in rows[0] if k != "prompt"}
        cols["prompts"] = [r["prompt"] for r in rows for _ in range(G)]
        sc = score(self.reward_funcs, self.reward_weights, texts, cols)
        lengths = torch.tensor([len(c.token_ids) for c in outs])
        total = torch.tensor(sc.total, dtype=torch.float32)
        total = total + overlong_penalty(lengths, cfg.max_completion_length, cfg.overlong_buffer_len,
                                         cfg.overlong_penalty_factor)
        return dict(outs=outs, texts=texts, scores=sc, rewards=total.view(-1, G), lengths=lengths,
                    stats=self.engine.stats)

    def _select(self, rounds, P):
        """Groups for the update: informative ones first (dynamic sampling), then fill with the rest."""
        keep, rest = [], []
        for r in rounds:
            info = informative_groups(r["rewards"]) if self.cfg.dynamic_sampling else torch.ones(len(r["rewards"]), dtype=torch.bool)
            for g in range(len(r["rewards"])):
                (keep if info[g] else rest).append((r, g))
        return (keep + rest)[:P], len(keep)

    def train_step(self) -> dict:
        cfg, step, G, D = self.cfg, self.step, self.cfg.num_generations, self.dist
        P = cfg.generation_batch_size // G // D.world  # this rank's prompts (the step's share)
        t0 = time.perf_counter()
        sigma, stage = sigma_at(step, cfg.max_steps, min(cfg.aqn_stages, cfg.max_steps), cfg.aqn_sigma_start, cfg.aqn_sigma_end,
                                cfg.aqn_schedule) if self.aqn is not None else (0.0, 0)
        base_seed = cfg.seed * 1_000_003 + step * 101
        off, mine = D.shard(self.sampler.take(P * D.world))  # every rank draws the same global prompts
        rounds, n_info = [self._rollout_round(mine, sigma, base_seed, off)], 0
        eff_sigma = self.aqn.last_effective_sigma if self.aqn is not None else 0.0
        _, n_info = self._select(rounds, P)
        while cfg.dynamic_sampling and len(rounds) <= cfg.max_resample_rounds:
            # DAPO: every rank tops up its own share; the ranks agree on how many prompts to draw
            need = int(D.sum(max(0, P - n_info), self.device))  # a rank with a surplus needs none
            if need <= 0:
                break
            off, mine = D.shard(self.sampler.take(-(-need // D.world) * D.world))
            rounds.append(self._rollout_round(mine, sigma, base_seed + len(rounds), off))
            _, n_info = self._select(rounds, P)
        groups, n_info = self._select(rounds, P)
        if cfg.dynamic_sampling:
            # DAPO trains on informative groups only; an all-equal group has zero advantage and would
            # only dilute the token mean (and cost a forward and backward)
            groups = groups[:n_info]
        t_roll = time.perf_counter() - t0

        # flatten the chosen groups into completions
        comp, adv, rollout_lp = [], [], []
        for r, g in groups:
            a = group_advantages(r["rewards"][g: g + 1], cfg.scale_rewards if cfg.scale_rewards != "batch" else "none")
            for j in range(G):
                c = r["outs"][g * G + j]
                comp.append(c)
                adv.append(float(a[0, j]))
                rollout_lp.append(c.logprobs)
        adv_t = torch.tensor(adv)
        if cfg.scale_rewards == "batch":  # the std of the whole step's chosen rewards, over all ranks
            mine_r = [float(x) for r, g in groups for x in r["rewards"][g]]
            allr = torch.tensor([x for part in D.gather(mine_r) for x in part])
            if len(allr) > 1:
                adv_t = adv_t / (allr.std() + 1e-4)
        truncated = torch.tensor([c.finish_reason == "length" for c in comp])
        N = len(comp)

        # metrics over everything sampled this step (before filtering), over all ranks
        mine_m = {"r": [float(x) for r in rounds for x in r["rewards"].flatten()],
                  "len": [int(x) for r in rounds for x in r["lengths"]],
                  "trunc": sum((c.finish_reason == "length") for r in rounds for c in r["outs"]),
                  "groups": sum(len(r["rewards"]) for r in rounds), "info": n_info, "rounds": len(rounds),
                  "errors": sum(r["scores"].errors for r in rounds),
                  "tokens": sum(r["stats"].new_tokens for r in rounds), "seconds": sum(r["stats"].seconds for r in rounds),
                  "nll": sum(-x for r in rounds for c in r["outs"] for x in c.logprobs),
                  "per_func": {k: [v for r in rounds for v in r["scores"].per_func[k]] for k in rounds[0]["scores"].per_func},
                  "first_error": next((r["scores"].first_error for r in rounds if r["scores"].first_error), None)}
        parts = D.gather(mine_m)
        all_r = torch.tensor([x for q in parts for x in q["r"]])
        all_len = torch.tensor([x for q in parts for x in q["len"]], dtype=torch.float32)
        m = {"step": step, "sigma": sigma, "aqn_stage": stage, "aqn_sigma_effective": eff_sigma,
             "lr": self.scheduler.get_last_lr()[0], "reward_mean": float(all_r.mean()), "reward_std": float(all_r.std()),
             "completion_length_mean": float(all_len.mean()), "completion_length_max": float(all_len.max()),
             "truncated_fraction": sum(q["trunc"] for q in parts) / len(all_len),
             "rollout_rounds": max(q["rounds"] for q in parts),
             "filtered_group_fraction": 1 - sum(q["info"] for q in parts) / sum(q["groups"] for q in parts),
             "reward_errors": sum(q["errors"] for q in parts),
             # mean -log p of the sampled tokens: the behaviour policy's entropy (AQN noise included) as
             # sampled, an estimate of `entropy` (the noiseless training forward's) when top-p/top-k are off
             "rollout_entropy": sum(q["nll"] for q in parts) / max(1, sum(q["tokens"] for q in parts)),
             # all ranks' new tokens over the slowest rank's rollout time
             "rollout_tokens_per_s": sum(q["tokens"] for q in parts) / max(1e-9, max(q["seconds"] for q in parts))}
        for name in parts[0]["per_func"]:
            vals = [v for q in parts for v in q["per_func"][name]]
            key = {"accuracy": "accuracy", "format": "format_rate"}.get(name, f"rewards/{name}")
            m[key] = sum(vals) / len(vals)
        errs = [q["first_error"] for q in parts if q["first_error"]]
        if errs:
            m["reward_first_error"] = errs[0]
        if D.world > 1:
            m["world_size"] = D.world

        # the update (every rank enters it: the gradient average is collective, even for an empty share)
        if D.sum(len(comp), self.device):
            m.update(self._update(comp, adv_t, rollout_lp, truncated, sigma, base_seed))
        else:  # nothing informative this step: no update (loss, entropy, grad norm are not logged)
            m.update({"time_logprob": 0.0, "time_update": 0.0, "updates": 0})
        m["time_rollout"] = t_roll
        m["time_step"] = time.perf_counter() - t0
        m["completions"] = int(D.sum(N, self.device))
        self.step += 1
        return m

    def _batch(self, idx, comp):
        ids, att, pos, tg, mask = pad_batch([comp[i].prompt_ids for i in idx], [comp[i].token_ids for i in idx],
                                            pad_id=self.tok.pad_token_id or 0)
        return ids, att, pos, tg, mask

    def _logprobs(self, batch, grad: bool):
        with torch.set_grad_enabled(grad), unfused_lora():
            return completion_logprobs(self.model, *batch, temperature=self.cfg.temperature,
                                       chunk=self.cfg.logprob_chunk_size)

    def _update(self, comp, adv, rollout_lp, truncated, sigma, seed) -> dict:
        cfg, dev, D = self.cfg, self.device, self.dist
        N = len(comp)
        mb = cfg.per_device_train_batch_size
        # the ranks step the optimizer together: as many updates as the rank with the most completions
        n_updates = int(D.max(max(1, math.ceil(math.ceil(N / mb) / cfg.gradient_accumulation_steps)), dev))
        single = cfg.num_iterations == 1 and n_updates == 1

        def noise_train():  # the step's noise, the same Z as the rollout's, entered per pass
            return self._noise(sigma, seed) if cfg.aqn_in_training else contextlib.nullcontext()
        t0 = time.perf_counter()
        micro = [list(range(s, min(N, s + mb))) for s in range(0, N, mb)]
        batches = [self._batch(i, comp) for i in micro]
        rl_lp = []
        for idx, b in zip(micro, batches):
            mask = b[4]
            t = torch.zeros(mask.shape)
            t = t.masked_scatter(mask, torch.tensor([x for i in idx for x in rollout_lp[i]], dtype=torch.float32))
            rl_lp.append(t.to(dev))
        old, ref, ent = [None] * len(micro), [None] * len(micro), []
        with noise_train():
            if not single:  # the sampling policy's logprobs before any update (PPO's old policy)
                for k, b in enumerate(batches):
                    lp, en = self._logprobs(b, grad=False)
                    old[k] = lp
                    ent.append(en[b[4].to(dev)])
        if cfg.beta:
            for layer in self.model.modules():
                if isinstance(layer, QLoRALinear):
                    layer.disable_adapters = True
            try:
                ref = [self._logprobs(b, grad=False)[0] for b in batches]
            finally:
                for layer in self.model.modules():
                    if isinstance(layer, QLoRALinear):
                        layer.disable_adapters = False
        t_lp = time.perf_counter() - t0

        t1 = time.perf_counter()
        self.model.train()
        stats = {"clip_fraction": [], "kl": [], "loss": [], "grad_norm": []}
        mism, mism_max, is_mean = [], 0.0, []
        order = list(range(len(micro)))
        for it in range(cfg.num_iterations):
            for u in range(n_updates):
                group = order[u * cfg.gradient_accumulation_steps:(u + 1) * cfg.gradient_accumulation_steps]
                # dapo's token mean over the whole update, all ranks: gradients are averaged over the
                # ranks below, so each rank divides its token sum by (all tokens / world size)
                norm_tokens = D.sum(sum(int(batches[k][4].sum()) for k in group), dev) / D.world
                # the other losses average over the update's micro-batches, all ranks' (a rank with fewer
                # or none must not weigh its own more): divide by their count / world size
                n_micro = D.sum(len(group), dev) / D.world if cfg.loss_type != "dapo" else 1.0
                upd_loss, bad = 0.0, None
                for k in group:
                    b = batches[k]
                    mask = b[4].to(dev)
                    with noise_train():  # forward and backward see the same weights
                        lp, en = self._logprobs(b, grad=True)
                        old_k = lp.detach() if single else old[k]
                        if it == 0:  # once per micro-batch: the pre-update policy vs the rollout's numbers
                            d = (old_k - rl_lp[k]).abs()[mask]
                            if d.numel():
                                mism.append(d)
                                mism_max = max(mism_max, float(d.max()))
                            if single:
                                ent.append(en[mask])
                        isw = None
                        if cfg.importance_sampling_correction:
                            isw = torch.exp(old_k - rl_lp[k]).clamp(max=cfg.importance_sampling_cap).detach()
                            is_mean.append(float(isw[mask].mean()) if mask.any() else 1.0)
                        lmask = mask & ~truncated[micro[k]].to(dev)[:, None] if cfg.mask_truncated_completions else mask
                        loss, st = policy_loss(lp, old_k, adv[micro[k]].to(dev), lmask, loss_type=cfg.loss_type,
                                               epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high, beta=cfg.beta,
                                               ref_logp=ref[k] if ref is not None else None, is_weights=isw,
                                               norm_tokens=norm_tokens, max_completion_length=cfg.max_completion_length)
                        if cfg.loss_type != "dapo":
                            loss = loss / n_micro
                        if not torch.isfinite(loss.detach()):
                            bad = f"loss is {float(loss.detach())}"
                            continue  # no backward; all ranks learn of it below and stop together
                        loss.backward()
                        upd_loss += float(loss.detach())
                    stats["clip_fraction"].append(st["clip_fraction"])
                    if "kl" in st:
                        stats["kl"].append(st["kl"])
                if D.max(1.0 if bad else 0.0, dev):
                    self.optimizer.zero_grad(set_to_none=True)
                    raise TrainingError(self._bad(bad or "the loss is not finite on another rank"))
                D.mean_grads_(self.params)
                gn = torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf"))
                if not torch.isfinite(gn):
                    self.optimizer.zero_grad(set_to_none=True)
                    raise TrainingError(self._bad(f"gradient norm is {float(gn)}"))
                stats["grad_norm"].append(float(gn))
                stats["loss"].append(upd_loss)
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
        self.model.eval()
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
        allm = torch.cat(mism) if mism else torch.zeros(0)
        ent_t = torch.cat(ent) if ent else torch.zeros(0)
        parts = D.gather({"loss": stats["loss"], "clip": stats["clip_fraction"], "kl": stats["kl"], "is": is_mean,
                          "ent": (float(ent_t.sum()), ent_t.numel()), "mism": (float(allm.sum()), allm.numel()),
                          "mism_max": mism_max})
        # each rank's update loss is its share of the global mean (gradients are averaged): average them
        losses = [mean([q["loss"][i] for q in parts]) for i in range(len(stats["loss"]))]
        cat = lambda k: [x for q in parts for x in q[k]]  # noqa: E731
        tot = lambda k: (sum(q[k][0] for q in parts), sum(q[k][1] for q in parts))  # noqa: E731
        (es, en), (ms, mn) = tot("ent"), tot("mism")
        out = {"loss": mean(losses),
               "clip_fraction": mean(cat("clip")), "grad_norm": mean(stats["grad_norm"]),
               "entropy": es / en if en else 0.0,
               "logprob_mismatch_mean": ms / mn if mn else 0.0,
               "logprob_mismatch_max": max(q["mism_max"] for q in parts),
               "time_logprob": t_lp, "time_update": time.perf_counter() - t1, "updates": cfg.num_iterations * n_updates}
        if cat("kl"):
            out["kl"] = mean(cat("kl"))
        if cat("is"):
            out["is_weight_mean"] = mean(cat("is"))
        return out

    def _bad(self, what: str) -> str:
        last = ckpt.checkpoints(self.out)
        keep = f"the last good checkpoint is {last[-1]}" if last else "no checkpoint was written yet"
        return f"step {self.step}: {what}; the step's update was not applied and training stops ({keep})"

    # ---- evaluation ------------------------------------------------------------------------
    def _eval_slots(self) -> int:
        cfg = self.cfg
        evaluates = cfg.eval_steps or cfg.eval_on_start or cfg.eval_on_end
        return cfg.eval_num_samples * (cfg.eval_limit or 256) if evaluates else 0

    def eval_set(self):
        """(rows, accuracy function, name) of the held-out set."""
        cfg = self.cfg
        if cfg.eval_dataset_name:
            from ..tasks import get_task

            t = get_task(cfg.eval_dataset_name, **cfg.eval_dataset_config)
            rows, func, name = t.eval, t.accuracy_func(), cfg.eval_dataset_name
        elif self._eval_rows is not None:
            acc = [f for f in self.reward_funcs if getattr(f, "metric", None) == "accuracy"]
            rows, func, name = self._eval_rows, (acc or self.reward_funcs)[0], "eval_dataset"
        elif self.task is not None:
            rows, func, name = self.task.eval, self.task.accuracy_func(), self.task.name
        else:
            raise ValueError("evaluation needs eval_dataset_name, an eval_dataset or a task with a held-out split")
        return (rows[:cfg.eval_limit] if cfg.eval_limit else rows), func, name

    def evaluate(self, log: MetricsLog | None = None):
        """pass@1 on the held-out set with the current adapter (no AQN noise); writes
        output_dir/eval/step_N.json and, given `log`, a metrics row."""
        from .evaluate import evaluate

        cfg = self.cfg
        rows, func, name = self.eval_set()
        rep = evaluate(self.engine, self.tok, rows, func, samples=cfg.eval_num_samples, temperature=cfg.eval_temperature,
                       top_p=cfg.eval_top_p, max_new_tokens=cfg.eval_max_completion_length or cfg.max_completion_length,
                       seed=cfg.seed, system_prompt=cfg.system_prompt, prompt_suffix=cfg.prompt_suffix,
                       max_prompt_length=cfg.max_prompt_length, dataset=name, progress=self.progress)
        rep.write(self.out / "eval" / f"step_{self.step}.json")
        row = {"step": self.step, "eval_pass_at_1": rep.pass_at_1, "eval_stderr": rep.stderr,
               "eval_mean_score": rep.mean_score, "eval_completion_length_mean": rep.completion_length_mean,
               "eval_problems": rep.problems, "eval_samples": rep.samples, "time_eval": rep.seconds}
        if log is not None:
            log.write(row)
        self.evals.append(row)
        if not self.progress:
            print(f"eval step {self.step}: {rep.summary()}", flush=True)
        return rep

    # ---- checkpoints -----------------------------------------------------------------------
    def save(self) -> Path | None:
        """Rank 0 writes the checkpoint (the ranks' adapters, optimizer states and data positions
        are identical); the others wait for it. A checkpoint holds nothing per rank, so a run
        resumes with the same or a different number of ranks."""
        path = None
        if self.dist.is_main:
            extra = {"data": self.sampler.state(), "config": self.cfg.to_dict(), "world_size": self.dist.world,
                     "updates_per_step": self._updates_per_step}
            path = ckpt.save_checkpoint(self.out, self.step, self.model, self.optimizer, self.scheduler, extra,
                                        base_name=self.cfg.model_name_or_path, keep=self.cfg.save_total_limit)
        self.dist.barrier()
        return path

    def _claim(self, fresh: bool) -> None:
        """Lock the run folder and clean what a killed save left; a fresh run's folder must hold no
        earlier run (or overwrite_output_dir clears it). Rank 0 does it; every rank stops on its error."""
        err = None
        if self._lock is not None:
            try:
                self._lock.acquire()
                if not self._claimed:
                    run_folder.clean_temporaries(self.out)
                    if fresh:
                        run_folder.refuse_or_clear(self.out, self.cfg.overwrite_output_dir)
            except (run_folder.RunFolderError, OSError) as e:
                err = e
        if self.dist.max(1.0 if err else 0.0, self.device):
            self._release()  # a lock we took is not left behind by a refusal
            raise err or run_folder.RunFolderError(f"{self.out}: rank 0 could not claim the run folder")
        self._claimed = True

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()

    def _newest_good_checkpoint(self) -> tuple[Path, dict]:
        """Load the newest checkpoint whose files all verify, skipping (and setting aside) corrupt ones."""
        found = ckpt.checkpoints(self.out, complete=False)
        if not found:
            raise FileNotFoundError(f"{self.out}: no checkpoint to resume from")
        skipped = []
        for folder in reversed(found):
            try:
                st = ckpt.load_checkpoint(folder, self.model, self.optimizer, self.scheduler)
            except ckpt.CorruptCheckpoint as e:
                print(f"qerl: resume: skipping {folder.name}: {e}", flush=True)
                skipped.append((folder, str(e)))
                continue
            if self._lock is not None:
                for bad, _ in skipped:  # out of the rotation and of later resumes; kept for a look
                    aside = bad.with_name(bad.name + ".corrupt")
                    n = 1
                    while aside.exists():  # set aside before, in an earlier resume
                        aside, n = bad.with_name(f"{bad.name}.corrupt{n}"), n + 1
                    os.replace(bad, aside)
                    print(f"qerl: resume: moved {bad.name} to {aside.name}", flush=True)
            return folder, st
        raise ckpt.CorruptCheckpoint(f"{self.out}: no checkpoint verifies: " + "; ".join(why for _, why in skipped))

    def resume(self, folder=None) -> int:
        """Continue from `folder`, or the run directory's newest checkpoint that verifies. Returns the step."""
        self._claim(fresh=False)
        try:
            if folder is None:
                folder, st = self._newest_good_checkpoint()
            else:
                st = ckpt.load_checkpoint(folder, self.model, self.optimizer, self.scheduler)
        except BaseException:
            self._release()
            raise
        self.step = st["step"]
        then = st.get("updates_per_step", self._updates_per_step)
        if then != self._updates_per_step:
            # another number of ranks makes another number of updates a step: the schedule's position
            # counts updates, so move it to the same step of the schedule
            sch = self.scheduler
            sch.last_epoch = round(sch.last_epoch * self._updates_per_step / then)
            for g, base, f in zip(self.optimizer.param_groups, sch.base_lrs, sch.lr_lambdas):
                g["lr"] = base * f(sch.last_epoch)
            sch._last_lr = [g["lr"] for g in self.optimizer.param_groups]
        self.sampler = PromptSampler(len(self.train_rows), self.cfg.seed, st["data"]["epoch"], st["data"]["pos"])
        self._resumed_from = Path(folder)
        return self.step

    # ---- the run ---------------------------------------------------------------------------
    def train(self, stop_after: int | None = None) -> list[dict]:
        """Run to max_steps (or stop after `stop_after` more steps, as a killed run would, but with a
        checkpoint at the stop); returns the metrics rows of this run."""
        self._claim(fresh=self._resumed_from is None)
        try:
            return self._train(stop_after)
        finally:
            self._release()

    def _train(self, stop_after: int | None) -> list[dict]:
        cfg, main = self.cfg, self.dist.is_main
        end = cfg.max_steps if stop_after is None else min(cfg.max_steps, self.step + stop_after)
        log = None
        if main:  # rank 0 logs; the metrics it writes are already aggregated over the ranks
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "config.yaml").write_text(cfg.to_yaml())
            continuing = self._resumed_from is not None or self.step > 0  # a resume, or train() called again
            log = MetricsLog(self.out, cfg.report_to, resume_step=self.step if continuing else None)
        rows = []
        bar = tqdm(total=cfg.max_steps, initial=self.step, desc="train", unit="step",
                   disable=not (self.progress and main))
        # On the CPU no kernel decodes 4-bit weights in registers: keep each frozen weight's
        # dequantized copy for the whole run (they never change) instead of rebuilding it per call.
        from ..kernels import dispatch

        cache = dispatch.dequantized_cache() if self.device.type == "cpu" else contextlib.nullcontext()
        cache.__enter__()
        try:
            if cfg.eval_on_start and self.step == 0 and self._resumed_from is None:
                self._evaluate_on_main(log)
            if cfg.eval_on_end and self._resumed_from is not None and self.step == cfg.max_steps == end:
                self._evaluate_on_main(log)  # stopped after its last checkpoint, before its last evaluation
            while self.step < end:
                m = self.train_step()
                if log is not None:
                    log.write(m)
                rows.append(m)
                bar.update(1)
                bar.set_postfix(reward=f"{m['reward_mean']:.3f}", sigma=f"{m['sigma']:.1e}", len=f"{m['completion_length_mean']:.0f}")
                if cfg.logging_steps and m["step"] % cfg.logging_steps == 0 and not self.progress and main:
                    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items()
                                   if k in ("step", "reward_mean", "accuracy", "entropy", "sigma", "loss", "grad_norm",
                                            "completion_length_mean", "time_step")), flush=True)
                if self.step % cfg.save_steps == 0 or self.step == end:
                    self.save()
                last = self.step == cfg.max_steps
                if (cfg.eval_steps and self.step % cfg.eval_steps == 0) or (last and cfg.eval_on_end):
                    self._evaluate_on_main(log)
        finally:
            cache.__exit__(None, None, None)
            bar.close()
            if log is not None:
                log.close()
        from ..checkpoint.peft_adapter import save_adapter

        if main:
            save_adapter(self.model, self.out / "adapter", base_model_name_or_path=cfg.model_name_or_path)
        self.dist.barrier()
        return rows

    def _evaluate_on_main(self, log):
        """Rank 0 evaluates (its adapter is every rank's); the others wait at the barrier."""
        if self.dist.is_main:
            self.evaluate(log)
        self.dist.barrier()
