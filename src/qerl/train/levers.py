"""The update's memory levers, chosen from the memory there is (issue 23 §2).

Gradient checkpointing and the logprob chunk trade time for memory. A fixed default either
wastes a big card (recomputing activations it could keep) or runs a small one out of memory, so
fields left unset (null) are chosen at start from the free memory (or the cap) and the model's
shape, and printed; a value the user sets always wins.

The estimate counts what autograd keeps per token of a micro-batch in one decoder layer of a
Llama/Qwen-style model whose base weights are frozen (LoRA saves the same layer inputs):
  norms' inputs 2h, q|k|v input h, rotary q/k h + kv, attention q/k/v/out h + 2kv + h, o input h,
  gate|up input h, gate, up and SiLU outputs 3i, down input i   ->  (8h + 3kv + 4i) elements.
With checkpointing a layer keeps only its input (h) and one layer's activations exist at a time
during the recompute. The logprob chunk holds fp32 logits, their softmax and its gradient.

On the CPU the budget is not all of the free RAM (issue 50): a laptop's RAM is shared with everything
else on it, and an update that took what was free on a 23 GiB machine (7.7 GiB of fp32 activations,
the default run's 7.3 GiB peak RSS) swaps or fails on an 8 GB one. CPU_BUDGET caps it, so a larger
micro-batch gets gradient checkpointing there rather than the machine's memory. The estimate is an upper
bound: the trainer counts every completion padded to max_prompt_length + max_completion_length, where a
packed micro-batch holds each prompt once and completions end early (the default run's micro-batch of 16
in fp32: ~3.8 GiB estimated, ~1 GiB measured), so the cap sits above the memory it is meant to keep to.
"""

from __future__ import annotations

from dataclasses import dataclass

ACT_BYTES = 2          # bf16 activations (GPUs), where the model's config names no dtype
CPU_BUDGET = 5 * 2**30  # the most of the CPU's available RAM the update's activations are planned for
HEADROOM = 0.8         # of the free memory the estimate may use (allocator slack, optimizer temporaries)
CHUNK_SHARE = 0.05     # of the budget the logprob chunk may hold
CHUNKS = (8192, 4096, 2048, 1024, 512, 256)


@dataclass
class Shape:
    hidden: int
    intermediate: int
    kv: int  # key/value width: kv heads x head dim
    layers: int
    vocab: int
    act_bytes: int = ACT_BYTES  # bytes per activation element: the model's dtype (fp32 on most CPUs)

    @classmethod
    def of(cls, config) -> "Shape":
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        dtype = getattr(config, "dtype", None)  # a loaded model's (transformers sets it); none in a bare config
        act = dtype.itemsize if getattr(dtype, "is_floating_point", False) else ACT_BYTES
        return cls(config.hidden_size, config.intermediate_size, kv_heads * head_dim, config.num_hidden_layers,
                   config.vocab_size, act)

    def layer_elements(self) -> int:
        """Elements autograd keeps per token in one layer without checkpointing."""
        return 8 * self.hidden + 3 * self.kv + 4 * self.intermediate


@dataclass
class Levers:
    gradient_checkpointing: bool
    logprob_chunk_size: int
    activation_bytes: int    # estimated peak of the update's activations with these choices
    budget_bytes: int        # what they may use
    chosen: tuple[str, ...]  # the levers picked here (the rest were set by the user)

    def fits(self) -> bool:
        return self.activation_bytes <= self.budget_bytes

    def describe(self) -> str:
        gib = 2**30
        how = ", ".join(f"{k}={getattr(self, k)}" for k in self.chosen) or "all set by the config"
        fit = "fits" if self.fits() else "does NOT fit: lower per_device_train_batch_size or max_completion_length"
        return (f"update memory: ~{self.activation_bytes / gib:.1f} GiB of activations in a {self.budget_bytes / gib:.1f} "
                f"GiB budget ({fit}); chosen from memory: {how}")


def activation_bytes(shape: Shape, tokens: int, checkpointing: bool, chunk: int) -> int:
    """Peak activation bytes of a forward + backward over `tokens` tokens (a micro-batch's)."""
    layer = shape.layer_elements() * shape.act_bytes * tokens
    if checkpointing:
        body = shape.layers * shape.hidden * shape.act_bytes * tokens + layer  # layer inputs + one layer recomputed
    else:
        body = shape.layers * layer
    return body + 3 * chunk * shape.vocab * 4


def choose(shape: Shape, tokens: int, free_bytes: int, *, gradient_checkpointing: bool | None,
           logprob_chunk_size: int | None) -> Levers:
    """Fill the unset levers: the largest logprob chunk within CHUNK_SHARE of the budget, and
    checkpointing only when the activations would not fit without it."""
    budget = int(free_bytes * HEADROOM)
    chosen = []
    chunk = logprob_chunk_size
    if chunk is None:
        chunk = next((c for c in CHUNKS if 3 * c * shape.vocab * 4 <= CHUNK_SHARE * budget), CHUNKS[-1])
        chosen.append("logprob_chunk_size")
    ckpt = gradient_checkpointing
    if ckpt is None:
        ckpt = activation_bytes(shape, tokens, False, chunk) > budget
        chosen.append("gradient_checkpointing")
    return Levers(ckpt, chunk, activation_bytes(shape, tokens, ckpt, chunk), budget, tuple(chosen))


def free_memory(device) -> int:
    """Bytes free for the update: the GPU's free memory under any cap, or the machine's available RAM up to
    CPU_BUDGET."""
    import torch

    if torch.device(device).type == "cuda":
        from ..device_memory import free_bytes

        return free_bytes(device)
    return min(available_ram(), CPU_BUDGET)


def available_ram(meminfo: str = "/proc/meminfo") -> int:
    """The RAM a new allocation can have: MemAvailable (free pages plus the page cache the kernel gives
    back), not MemFree, which made the same config choose gradient checkpointing off, then on, as files
    were read. MemFree (sysconf) only where there is no /proc/meminfo."""
    import os

    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _forward_kernel_settings():
    """torch.utils.checkpoint's context_fn: the recompute in the backward runs under the KernelSettings the
    forward ran under. They live in a ContextVar, which autograd's CUDA thread does not see: the recompute
    took other paths (the MoE loop instead of the grouped path) and checkpoint refused its tensors."""
    import contextlib

    from ..kernels import settings

    return contextlib.nullcontext(), settings.use(settings.current())


def checkpoint_kwargs() -> dict:
    """Non-reentrant (LoRA's frozen inputs need it), the forward's kernel choices kept for the recompute."""
    return {"use_reentrant": False, "context_fn": _forward_kernel_settings}


def enable_gradient_checkpointing(model) -> None:
    """Recompute the decoder layers' activations in backward (checkpoint_kwargs says how)."""
    kw = checkpoint_kwargs()
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x; the old name warns
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
