"""What both trainers stand on, built in one order by `TrainParts.build`: seeds, device and dtype, the ranks,
the policy (load_policy with every loading option of the config), the LoRA dtype (or fp32 master weights),
the trainable parameters (equal on every rank), the memory levers, the optimizer, the schedule, the profiler.

GRPO and SFT differ only in what they tell the build (`Needs`): what trains, how many tokens a
micro-batch holds, how many updates the run makes, and what they set up between two steps of it (GRPO
its rollout engine, whose memory the levers must leave free). The run loop (train/loop.py) receives
the built parts, nothing set behind its back.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import levers
from .config import TrainConfig
from .distributed import Dist
from .optim import lr_lambda, make_optimizer
from .profiling import Profiler


def resolve_device_dtype(cfg: TrainConfig):
    """(device, compute dtype) that a config's `device` and `dtype` fields name ("auto" resolved here)."""
    dev = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                       ("cpu" if cfg.device == "auto" else cfg.device))
    if cfg.dtype == "auto":
        dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    else:
        dt = getattr(torch, cfg.dtype)
    return dev, dt


def set_lora_dtype(model, dtype: torch.dtype, device: torch.device) -> None:
    """Keep every LoRA factor in `dtype` (the compute stays in the model's dtype: the LoRA branch
    casts its input, and its output back). Fused groups are rebuilt on the converted factors."""
    from ..layers import QLoRALinear
    from ..layers.fused_group import fused_groups
    from ..layers.quant_experts import QuantExperts

    layers = [m for m in model.modules() if isinstance(m, QLoRALinear) and m.r]
    experts = [m for m in model.modules() if isinstance(m, QuantExperts) and m.r]  # cast x and back themselves
    if (all(m.lora_A.weight.dtype == dtype for m in layers)
            and all(p.dtype == dtype for m in experts for p in m.lora_A.values())):
        return
    if layers and device.type == "cuda" and dtype != layers[0].dtype:
        raise ValueError(f"lora_dtype {str(dtype).removeprefix('torch.')} differs from the compute dtype "
                         f"{str(layers[0].dtype).removeprefix('torch.')}: the CUDA kernels read adapters in the compute "
                         "dtype (set lora_dtype: auto on a GPU)")
    for m in layers + experts:
        m.lora_A.to(dtype)
        m.lora_B.to(dtype)
    for _, g in fused_groups(model):
        g.attach_lora()


def lora_params(parts: "TrainParts") -> list:
    """The parameters that train by default: those left trainable by load_policy (the LoRA factors)."""
    return [p for p in parts.model.parameters() if p.requires_grad]


def _nothing(parts: "TrainParts") -> None:
    return None


@dataclass(frozen=True)
class Needs:
    """What a trainer tells `TrainParts.build`, each asked once, at its place in the order (each takes the
    parts built so far)."""
    micro_batch_tokens: Callable[["TrainParts"], int]  # tokens of one micro-batch: the levers' activation estimate
    total_updates: Callable[["TrainParts"], int]       # optimizer updates of the run: the schedule's length
    trainable: Callable[["TrainParts"], list] = lora_params
    on_ranks: Callable[["TrainParts"], None] = _nothing  # checks before the model loads (GRPO: the batch splits)
    on_policy: Callable[["TrainParts"], None] = _nothing  # after the policy loads (the data, read with its tokenizer)
    # after the parameters are broadcast, before the levers measure free memory: what the update must leave free
    reserve_bytes: Callable[["TrainParts"], int] = lambda parts: 0


@dataclass
class TrainParts:
    cfg: TrainConfig                 # final: memory levers left unset are filled in
    device: torch.device
    dtype: torch.dtype
    dist: Dist
    progress: bool = True
    label: str = "qerl"              # the prefix of the lines the build prints
    announce: bool = True            # print the memory levers chosen (on rank 0)
    policy: object = None            # model.Policy
    master_weights: bool = False     # the optimizer steps fp32 copies of low-precision LoRA factors
    params: list = field(default_factory=list)
    levers: levers.Levers | None = None
    optimizer: object = None
    optim_name: str = ""
    scheduler: object = None
    profiler: Profiler = field(default_factory=Profiler)  # each phase's seconds: the step's time_<phase> metrics

    @property
    def model(self):
        return self.policy.model

    @property
    def tok(self):
        return self.policy.tokenizer

    @classmethod
    def build(cls, cfg: TrainConfig, needs: Needs, *, policy=None, progress: bool = True, label: str = "qerl",
              announce: bool | None = None) -> "TrainParts":
        """announce: print the memory levers chosen (None: when `progress`)."""
        random.seed(cfg.seed)  # dropout and anything else on the global generators (resume restores them)
        torch.manual_seed(cfg.seed)
        device, dtype = resolve_device_dtype(cfg)
        dist = Dist.from_env(device.type, cfg.ddp_timeout, cfg.ddp_backend)
        if dist.world > 1 and device.type == "cuda":
            device = torch.device("cuda", dist.local_rank)
        parts = cls(cfg, device, dtype, dist, progress, label, progress if announce is None else announce)
        needs.on_ranks(parts)
        parts.policy = policy if policy is not None else load_configured_policy(cfg, device, dtype, progress)
        if parts.tok is None:
            raise ValueError("the policy has no tokenizer: training rows and rewards are text")
        parts._set_lora_dtype()
        needs.on_policy(parts)
        parts.params = needs.trainable(parts)
        if not parts.params:
            raise ValueError("nothing to train: the policy has no LoRA (lora_r = 0)"
                             + (" and train_norms is off" if hasattr(cfg, "train_norms") else ""))
        dist.broadcast_(parts.params)  # every rank starts from rank 0's adapter
        reserve = needs.reserve_bytes(parts)
        parts._choose_levers(needs.micro_batch_tokens(parts), reserve)
        parts.optimizer, parts.optim_name = make_optimizer(parts.cfg, parts.params, device, parts.master_weights)
        parts.scheduler = torch.optim.lr_scheduler.LambdaLR(parts.optimizer,
                                                            lr_lambda(parts.cfg, needs.total_updates(parts)))
        return parts

    def _set_lora_dtype(self) -> None:
        if self.cfg.lora_dtype == "auto":
            return
        want = getattr(torch, self.cfg.lora_dtype)
        if self.device.type == "cuda" and want == torch.float32 and self.dtype != torch.float32:
            self.master_weights = True  # the CUDA kernels read the adapters in the compute dtype
        else:
            set_lora_dtype(self.model, want, self.device)

    def _choose_levers(self, tokens: int, reserve: int) -> None:
        """Memory levers left unset in the config, chosen from what is free now (less `reserve`); the config
        is final from here."""
        cfg = self.cfg
        self.levers = levers.choose(levers.Shape.of(self.model.config), tokens,
                                    max(0, levers.free_memory(self.device) - reserve),
                                    gradient_checkpointing=cfg.gradient_checkpointing,
                                    logprob_chunk_size=cfg.logprob_chunk_size)
        if self.levers.chosen:
            self.cfg = cfg = dataclasses.replace(cfg, gradient_checkpointing=self.levers.gradient_checkpointing,
                                                 logprob_chunk_size=self.levers.logprob_chunk_size)
            if self.dist.is_main and self.announce:
                print(f"{self.label}: {self.levers.describe()}", flush=True)
        if cfg.gradient_checkpointing:
            levers.enable_gradient_checkpointing(self.model)


def load_configured_policy(cfg: TrainConfig, device, dtype, progress: bool):
    """load_policy with every loading option a training config has."""
    from ..model import load_policy

    policy = load_policy(cfg.model_name_or_path, cfg.quant, lora_rank=cfg.lora_r, lora_alpha=cfg.lora_alpha,
                         lora_dropout=cfg.lora_dropout, target_modules=cfg.lora_target_modules, device=device,
                         dtype=dtype, trust_remote_code=cfg.trust_remote_code, progress=progress,
                         modules_to_not_convert=cfg.modules_to_not_convert)
    if cfg.lm_head_4bit:
        from ..layers.quant_head import quantize_lm_head

        quantize_lm_head(policy.model)
    if cfg.embed_4bit:
        from ..layers.quant_embed import quantize_embedding

        quantize_embedding(policy.model)
    return policy
