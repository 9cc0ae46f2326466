"""The MoE step's memory model (bench/step_plan.py), term by term against what the project's own objects hold
when built at toy size on the CPU: the weights of a random policy built as `qerl bench step` builds it, the
rollout engine's KV cache as GRPOTrainer sizes it, the LoRA factors with their gradients and optimizer state
after a real optimizer step, the humming-kernels layout of the attention weights, the update's working set (the
bytes a checkpointed forward and backward of the built policy create, counted by LiveBytes); and, out of sample,
its prediction of one measured step (benchmarks/results/step.jsonl, read from the records) with its allowances
read off another.

Bytes are counted by storage (a fused group's members are views into one tensor: counted once)."""

import json
import weakref
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers as tf
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from qerl.bench import memory as bmem
from qerl.bench.step_plan import (CAPPED_FIT_RECORD, DEFAULT_ALLOWANCES, FIT_RECORD, LOGIT_BYTES, MOE_SHAPES,
                                  MoEShape, StepSettings, humming_copy_shapes, kv_slot_bytes, kv_slots, lora_bytes,
                                  model_memory, plan_step, update_tokens, update_working)
from qerl.kernels import settings
from qerl.layers import QLoRALinear
from qerl.layers.quant_experts import QuantExperts

GIB = 2**30
STEP = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "step.jsonl"
RANK = 8


def _configs():
    from qerl.model import moe_config

    # Qwen3-MoE's layout at toy size with heads of 64 (as Qwen3-30B-A3B's: every attention projection, and so the
    # fused q|k|v, tiles into humming's blocks of 128 rows); the repo's gpt-oss toy shape (biases, sinks, MXFP4
    # experts) with heads of 64, whose o (64 rows) does not tile, as gpt-oss-120b's (2880 rows) does not
    qwen = tf.Qwen3MoeConfig(architectures=["Qwen3MoeForCausalLM"], vocab_size=256, hidden_size=128,
                             intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                             norm_topk_prob=True, tie_word_embeddings=False, max_position_embeddings=512,
                             eos_token_id=1, pad_token_id=0)
    oss = moe_config("gpt-oss-tiny")
    oss.head_dim, oss.vocab_size = 64, 256
    return {"qwen3-moe": qwen, "gpt-oss": oss}


CONFIGS = _configs()


def _policy(name, **settings_kw):
    from qerl.bench.synthetic import synthetic_tokenizer
    from qerl.model import random_policy

    cfg = CONFIGS[name]
    with settings.use(**settings_kw):  # the stored layout is chosen at load (bench/step.py build_policy)
        pol = random_policy(cfg, "nvfp4", lora_rank=RANK, device="cpu", dtype=torch.bfloat16, progress=False)
    pol.tokenizer = synthetic_tokenizer(cfg.vocab_size)
    return pol, MoEShape.of(name, cfg)


class Storages:
    """Bytes by the storage they live in, each storage counted once, under the first kind that claims it."""

    def __init__(self):
        self.kind: dict[int, str] = {}
        self.nbytes: dict[int, int] = {}

    def add(self, kind: str, tensors) -> None:
        for t in tensors:
            if t is None:
                continue
            s = t.untyped_storage()
            self.kind.setdefault(s.data_ptr(), kind)
            self.nbytes[s.data_ptr()] = s.nbytes()

    def of(self, kind: str) -> int:
        return sum(b for p, b in self.nbytes.items() if self.kind[p] == kind)


def _shared_scales(model) -> int:
    """Bytes of the global scales the plan counts once per projection where a fused group keeps one for all its
    members (WeightFormat.nbytes of q, k and v each hold a fp32 gs; the q|k|v group stores one): 8 B a layer."""
    from qerl.layers.fused_group import fused_groups

    return sum(4 * (len(g.members) - 1) for parent, g in fused_groups(model)
               if parent.endswith("self_attn") and "weight_global_scale" in g.tensors)


def _measured_weights(model) -> Storages:
    """The built model's bytes: the experts' quantized tensors, attention's quantized tensors, the LoRA factors,
    and everything else (embeddings, lm_head, routers, norms, sinks, biases: the plan's `dense`)."""
    m = Storages()
    for mod in model.modules():
        if isinstance(mod, QuantExperts):
            m.add("experts", [b for k, b in mod.named_buffers(recurse=False) if not k.endswith("_bias")])
        if isinstance(mod, QLoRALinear):
            m.add("attention", mod.quant_tensors().values())
    m.add("lora", [p for p in model.parameters() if p.requires_grad])
    # the rotary tables (fp32 [head_dim / 2], twice) are no weight: the model leaves them out
    m.add("rotary", [b for n, b in model.named_buffers() if "rotary_emb" in n])
    m.add("dense", list(model.parameters()) + list(model.buffers()))
    return m


@pytest.mark.parametrize("name", list(CONFIGS))
def test_weight_terms_are_the_bytes_the_built_policy_holds(name):
    pol, shape = _policy(name)
    m = _measured_weights(pol.model)
    p = plan_step(shape, StepSettings(lora_rank=RANK))
    extra = _shared_scales(pol.model)
    assert (p.experts, p.attention, p.dense) == (m.of("experts"), m.of("attention") + extra, m.of("dense"))
    assert p.experts > 0 and p.attention > 0 and p.dense > 0
    # what `qerl bench step` reports as model_memory: the weights and the bf16 LoRA factors
    held = m.of("experts") + m.of("attention") + m.of("dense") + m.of("lora")
    assert model_memory(shape, lora_rank=RANK) == held + extra


def _trainer(pol, tmp_path, st: StepSettings, kv_dtype: str = "auto", optim: str = "adamw_torch"):
    """GRPOTrainer on `pol` with the step's settings, as `qerl bench step` configures it (bench/step.py)."""
    from qerl.bench.synthetic import random_prompts, synthetic_verifier
    from qerl.rl import GRPOConfig, GRPOTrainer

    g = st.rows // st.prompts
    cfg = GRPOConfig(model_name_or_path="random:toy", quant="nvfp4", lora_r=RANK, lora_alpha=2.0 * RANK, device="cpu",
                     dtype="bfloat16", max_steps=1, num_generations=g, generation_batch_size=st.rows,
                     per_device_train_batch_size=st.micro_batch, gradient_accumulation_steps=st.rows // st.micro_batch,
                     max_prompt_length=st.prompt_len, max_completion_length=st.new_tokens,
                     rollout_kv_cache_gb=st.kv_cache_gb, rollout_kv_cache_dtype=kv_dtype, optim=optim,
                     dynamic_sampling=False, loss_type="dapo", parity_check_steps=0, learning_rate=1e-3,
                     save_steps=10**9, report_to="none", output_dir=str(tmp_path / "run"))
    return GRPOTrainer(cfg, policy=pol, reward_funcs=[synthetic_verifier], progress=False,
                       train_dataset=random_prompts(st.prompts, st.prompt_len, pol.config.vocab_size))


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("budget_slots", [5.5, None])  # a budget of 5.5 slots, or one that holds every row
def test_kv_term_is_the_cache_the_trainers_engine_allocates(name, kv_dtype, budget_slots, tmp_path):
    pol, shape = _policy(name)
    st = StepSettings(rows=8, prompts=2, prompt_len=24, new_tokens=16, micro_batch=2, lora_rank=RANK,
                      kv_bytes=1 if kv_dtype == "fp8" else 2)
    # the budget in slots of the real cache (a first engine's bytes over its slots), not of the plan
    one = _trainer(pol, tmp_path / "one", replace(st, kv_cache_gb=1.0), kv_dtype).engine.cache
    per_slot = sum(t.untyped_storage().nbytes() for t in one.k + one.v + one.k_scale + one.v_scale
                   if t is not None) // one.n_slots
    st = replace(st, kv_cache_gb=(budget_slots or 100) * per_slot / GIB)
    eng = _trainer(pol, tmp_path / "run", st, kv_dtype).engine
    c = eng.cache
    held = sum(t.untyped_storage().nbytes() for t in c.k + c.v + c.k_scale + c.v_scale if t is not None)
    assert eng.n_slots == c.n_slots == kv_slots(shape, st) == (5 if budget_slots else st.rows)
    assert kv_slot_bytes(shape, st) == held // c.n_slots
    assert plan_step(shape, st).kv_cache == held


def _one_update(tr):
    """One backward through the policy and one optimizer step: the gradients and the optimizer state exist."""
    ids = torch.randint(2, tr.model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    tr.model.train()
    tr.model(input_ids=ids).logits.float().square().mean().backward()
    tr.optimizer.step()
    assert all(p.grad is not None for p in tr.params) and len(tr.optimizer.state) == len(tr.params)


def _measured_lora(params, optimizer) -> int:
    m = Storages()
    m.add("factors", params)
    m.add("grads", [p.grad for p in params])
    masters = getattr(optimizer, "masters", [])  # MasterWeights: fp32 copies and their fp32 gradients
    m.add("masters", masters)
    m.add("masters", [p.grad for p in masters])
    # AdamW's moments; its `step` counters (a 0-d fp32 tensor per parameter) are no memory term
    m.add("state", [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()])
    return sum(m.of(k) for k in ("factors", "grads", "masters", "state"))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_lora_term_is_the_factors_gradients_and_adamw_state_after_a_step(name, tmp_path):
    pol, shape = _policy(name)
    st = StepSettings(rows=4, prompts=2, prompt_len=8, new_tokens=8, micro_batch=2, lora_rank=RANK, kv_cache_gb=0.01)
    tr = _trainer(pol, tmp_path, st)
    assert tr.optim_name == "adamw_torch" and all(p.dtype == torch.bfloat16 for p in tr.params)
    _one_update(tr)
    assert lora_bytes(shape, st) == _measured_lora(tr.params, tr.optimizer)
    assert plan_step(shape, st).lora_and_optimizer == lora_bytes(shape, st)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_lora_term_with_fp32_master_weights(name, tmp_path):
    """lora_dtype float32 on a GPU (bf16 compute): the trainer steps fp32 masters of the bf16 factors
    (TrainParts._set_lora_dtype); the same optimizer, built here by the call TrainParts makes there."""
    from qerl.train.optim import make_optimizer

    pol, shape = _policy(name)
    st = StepSettings(rows=4, prompts=2, prompt_len=8, new_tokens=8, micro_batch=2, lora_rank=RANK, kv_cache_gb=0.01)
    tr = _trainer(pol, tmp_path, st)
    tr.optimizer, name_ = make_optimizer(tr.cfg, tr.params, torch.device("cpu"), master_weights=True)
    assert "master" in name_
    _one_update(tr)
    assert lora_bytes(shape, replace(st, lora_dtype="float32")) == _measured_lora(tr.params, tr.optimizer)


def _attention_weights(model) -> list:
    """(shape, stored tensors) of each attention matmul of decoder layer 0: a fused group runs as one weight."""
    from qerl.layers.fused_group import fused_groups

    out, grouped = [], set()
    for parent, g in fused_groups(model):
        if parent == "model.layers.0.self_attn":
            out.append((g.shape, g.fmt, g.tensors))
            grouped.update(id(m) for m in g.members)
    attn = model.get_submodule("model.layers.0.self_attn")
    for mod in attn.children():
        if isinstance(mod, QLoRALinear) and id(mod) not in grouped:
            out.append((mod.weight_shape, mod.fmt, mod.quant_tensors()))
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_humming_copies_are_the_weights_stored_in_hummings_layout(name):
    """A humming copy holds what humming's layer holds after its repack: the tensors of formats/nvfp4_humming.py,
    which the loader stores instead under humming_storage. So the weights the loader stores that way are the
    ones that get copies, and their bytes are the copies' bytes."""
    from qerl.formats.nvfp4_humming import NVFP4Humming
    from qerl.kernels.humming_backend import supports_shape

    pol, shape = _policy(name, humming_storage=True)
    stored = [(s, t) for s, fmt, t in _attention_weights(pol.model) if isinstance(fmt, NVFP4Humming)]
    assert [tuple(s) for s, _ in stored] == humming_copy_shapes(shape)
    assert all(supports_shape(s) for s, _ in stored)  # the copy gate (kernels/mma_backend.py _humming) agrees
    # humming's codes and block scales (its fp32 1/gs and our gs, 8 bytes a weight, are not in the term)
    copy = sum(t[k].untyped_storage().nbytes() for _, t in stored for k in ("weight_packed", "weight_scale"))
    assert plan_step(shape, StepSettings()).kernel_copies == shape.layers * copy > 0
    # the layout stored holds the same bytes as NVFP4's: the attention term is unchanged, and no copies remain
    plain = _measured_weights(_policy(name)[0].model)
    humming = _measured_weights(pol.model)
    hs = plan_step(shape, StepSettings(humming_storage=True))
    assert hs.kernel_copies == 0
    extra = _shared_scales(pol.model)
    # (the humming layout keeps 1/gs beside gs: one fp32 more a weight)
    assert hs.attention - extra == plain.of("attention") == humming.of("attention") - 4 * shape.layers * len(stored)


def test_the_real_shapes_copies_follow_the_copy_gate():
    """gpt-oss-120b's o (2880 rows) is not a multiple of humming's 128-row blocks; Qwen3-30B-A3B's is."""
    from qerl.kernels.humming_backend import supports_shape

    for s in MOE_SHAPES.values():
        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        weights = [(q + 2 * kv, s.hidden), (s.hidden, q)]  # q|k|v fused, o
        assert humming_copy_shapes(s) == [w for w in weights if supports_shape(w)]
    assert len(humming_copy_shapes(MOE_SHAPES["qwen3-30b-a3b"])) == 2
    assert len(humming_copy_shapes(MOE_SHAPES["gpt-oss-120b"])) == 1


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages that ops under this mode create, while any tensor on them lives; `peak` the most at
    once. A view or an in-place op's output on a storage that was there before is no new memory."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[int, dict]] = {}  # storage pointer -> (bytes, the tensors on it)
        self.now = self.peak = 0

    def _gone(self, ptr: int, ref) -> None:
        entry = self.live.get(ptr)
        if entry is not None:
            entry[1].pop(id(ref), None)
            if not entry[1]:
                self.now -= entry[0]
                del self.live[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if torch.is_tensor(t)}
        for t in tree_flatten(out)[0]:
            if not torch.is_tensor(t):
                continue
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr == 0 or (ptr in inputs and ptr not in self.live):
                continue
            if ptr not in self.live:
                self.live[ptr] = (st.nbytes(), {})
                self.now += st.nbytes()
                self.peak = max(self.peak, self.now)
            ref = weakref.ref(t, lambda r, p=ptr: self._gone(p, r))
            self.live[ptr][1][id(ref)] = ref
        return out


def _set_path(model, grouped: bool) -> None:
    for m in model.modules():
        if isinstance(m, QuantExperts):
            m.grouped = grouped  # the CPU takes the loop unless told: the GPU's update takes the grouped path


def test_logit_bytes_are_a_measured_chunk():
    """LOGIT_BYTES: what one more chunk's worth of logits costs at the peak of train/logprobs.py's chunked
    forward and backward (two chunks' tokens against one, so the fixed part cancels)."""
    from qerl.train.logprobs import completion_logprobs

    V, D, L = 8192, 32, 256

    class Body(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(V, D, dtype=torch.bfloat16).requires_grad_(False)
            self.lin = torch.nn.Linear(D, D, dtype=torch.bfloat16)

        def forward(self, input_ids, attention_mask=None, **kw):
            return type("Out", (), {"last_hidden_state": self.lin(self.emb(input_ids))})

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Body()
            self.lm_head = torch.nn.Linear(D, V, bias=False, dtype=torch.bfloat16).requires_grad_(False)

        def get_input_embeddings(self):
            return self.model.emb

    m, g = Model(), torch.Generator().manual_seed(0)
    ids, tg = torch.randint(0, V, (1, L), generator=g), torch.randint(0, V, (1, L), generator=g)
    pos, mask = torch.arange(L)[None], torch.ones(1, L, dtype=torch.bool)
    peaks = {}
    for chunk in (64, 128):
        with LiveBytes() as lb:
            lp, _ = completion_logprobs(m, ids, torch.ones(1, L, dtype=torch.long), pos, tg, mask, chunk=chunk)
            lp.sum().backward()
        peaks[chunk] = lb.peak
    assert (peaks[128] - peaks[64]) / (64 * V) == pytest.approx(LOGIT_BYTES, rel=0.02)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_expert_inputs_kept_are_what_the_grouped_forward_leaves_alive(name):
    """After a checkpointed forward (the update's), the grouped path leaves alive, over the loop path, exactly
    the term for today's code: nothing. Before the fix its frozen matmul's closure held x, and every layer's
    expert inputs (every pair's token, every pair's gated product) in bf16 lived to the backward: the term the
    model still prices for records of that code (expert_inputs_kept=True)."""
    from qerl.train.levers import enable_gradient_checkpointing

    pol, shape = _policy(name)
    enable_gradient_checkpointing(pol.model)
    pol.model.train()
    st = StepSettings(micro_batch=1, prompt_len=127, new_tokens=1)  # one row of 128 tokens, packed or not
    t = update_tokens(shape, st)
    assert t == 128
    ids = torch.randint(2, shape.vocab, (1, t), generator=torch.Generator().manual_seed(0))
    alive = {}
    for grouped in (True, False):
        _set_path(pol.model, grouped)
        with LiveBytes() as lb:
            logits = pol.model(input_ids=ids).logits
            alive[grouped] = lb.now
        del logits
    assert alive[True] - alive[False] == update_working(shape, st)["expert_inputs_kept"] == 0
    assert update_working(shape, replace(st, expert_inputs_kept=True))["expert_inputs_kept"] > 0


@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_update_follows_the_trainers_rule(name):
    """The update packs a micro-batch unless the family has sliding-window layers (train/packing.py)."""
    from qerl.train.packing import has_sliding_window

    pol, shape = _policy(name)
    assert shape.packed == (not has_sliding_window(pol.model))
    st = StepSettings(micro_batch=2, prompt_len=64, new_tokens=32)
    assert update_tokens(shape, st) == (128 if shape.packed else 2 * 96)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("vocab", [256, 16384])  # the recomputed layer the larger part, or the logits chunk
def test_update_working_is_what_a_checkpointed_update_creates(name, vocab):
    """One micro-batch's forward and backward through train/logprobs.py on the built policy (grouped experts,
    checkpointed layers; a packed row, or padded rows for a family that trains unpacked): its peak of created
    bytes, less the LoRA gradients (a term of their own), against update_working's total: checkpoints + kept
    expert inputs + the larger of one logits chunk and one recomputed layer, not their sum."""
    from qerl.train.levers import enable_gradient_checkpointing
    from qerl.train.logprobs import completion_logprobs

    cfg = CONFIGS[name].__class__.from_dict(CONFIGS[name].to_dict())
    cfg.vocab_size = vocab
    from qerl.model import random_policy

    pol = random_policy(cfg, "nvfp4", lora_rank=RANK, device="cpu", dtype=torch.bfloat16, progress=False)
    shape = MoEShape.of(name, cfg)
    _set_path(pol.model, True)
    enable_gradient_checkpointing(pol.model)
    pol.model.train()
    st = StepSettings(prompt_len=64, new_tokens=32, micro_batch=2, lora_rank=RANK)
    rows, t = (1, update_tokens(shape, st)) if shape.packed else (st.micro_batch, st.prompt_len + st.new_tokens)
    n = st.micro_batch * st.new_tokens // rows  # completion tokens a row
    g = torch.Generator().manual_seed(0)
    ids, tg = torch.randint(2, vocab, (rows, t), generator=g), torch.randint(2, vocab, (rows, n), generator=g)
    pos = (torch.arange(n) + t - n - 1)[None].expand(rows, n).contiguous()
    with LiveBytes() as lb:
        lp, _ = completion_logprobs(pol.model, ids, torch.ones(rows, t, dtype=torch.long), pos, tg,
                                    torch.ones(rows, n, dtype=torch.bool), chunk=st.logprob_chunk)
        lp.sum().backward()
    grads = sum(p.grad.untyped_storage().nbytes() for p in pol.model.parameters() if p.grad is not None)
    u = update_working(shape, st)
    measured = lb.peak - grads
    if u["logits"] > u["layer"]:  # the logits chunk's peak, on top of what lives through the backward
        assert measured == pytest.approx(u["total"], rel=0.02)
    else:  # the layer's part is counted generously (x2 for every gradient): 14 % over at this size
        assert 0.8 * u["total"] <= measured <= u["total"]
    assert measured < u["checkpoints"] + u["expert_inputs_kept"] + u["logits"] + u["layer"]


def _measured(case: str, metric: str, commit: str) -> float:
    rows = [json.loads(x) for x in STEP.read_text().splitlines() if x.strip()]
    hit = [r["value"] for r in rows if r["case"] == case and r["metric"] == metric and r["commit"] == commit]
    assert hit, (case, metric, commit)
    return hit[-1]


@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "gpt-oss-120b"])
def test_model_memory_of_the_4_layer_records(shape):
    """The weights and LoRA factors at 4 layers against the H100's torch.cuda.memory_allocated after the build."""
    case = f"{shape} 4L nvfp4 8x8 prompt256 new16 mu1 mb2 ckpt adamw_torch"
    assert model_memory(MOE_SHAPES[shape], 4) / GIB == pytest.approx(_measured(case, "model_memory", "e65a2ba"),
                                                                      rel=0.01)


FULL_DEPTH = ["qwen3-30b-a3b nvfp4 8x8 prompt256 new256 mu1 mb2 ckpt kv3.4 adamw_torch@ed5e22d",
              "gpt-oss-120b nvfp4 8x8 prompt256 new128 mu1 mb2 ckpt kv2.6 adamw_torch@ed5e22d"]


@pytest.mark.parametrize("fit_on,predicted", [FULL_DEPTH, FULL_DEPTH[::-1]])
def test_one_full_depth_step_predicts_the_other_within_5_percent(fit_on, predicted):
    """Out of sample: the allowances read off one measured step alone, the other model's step predicted."""
    from qerl.bench import memory_fit as mf

    steps = mf.load_steps(STEP)
    allow = mf.fit(mf.select(steps, fit_on))
    p = mf.predict(mf.select(steps, predicted), allow)
    assert p.metric == "peak_reserved" and abs(p.error_pct) <= 5, (p.predicted, p.measured)


def test_bench_memory_projects_the_settings_its_flags_name(capsys):
    """Every flag of `qerl bench memory --step-only` reaches the plan: the printed terms are the plan of the
    settings written out here by hand."""
    bmem.main(["--step-only", "--shape", "qwen3-30b-a3b", "--prompts", "4", "--num-generations", "4",
               "--prompt-len", "128", "--max-new-tokens", "512", "--micro-batch", "1", "--logprob-chunk", "256",
               "--kv-cache-gb", "0.5", "--kv-cache-dtype", "fp8", "--optim", "adamw_8bit", "--lora-rank", "16",
               "--lora-dtype", "float32", "--expert-chunk", "4", "--humming-storage", "--memory-cap-gb", "22"])
    out = capsys.readouterr().out
    assert "gpt-oss" not in out
    printed = {x.split()[3]: float(x.split()[4]) for x in out.splitlines() if x.startswith("qwen3-30b-a3b step")}
    want = StepSettings(rows=16, prompts=4, prompt_len=128, new_tokens=512, micro_batch=1, logprob_chunk=256,
                        kv_cache_gb=0.5, kv_bytes=1, optim="adamw_8bit", lora_rank=16, lora_dtype="float32",
                        expert_chunk=4, humming_storage=True, memory_cap_gb=22.0)
    g = plan_step(MOE_SHAPES["qwen3-30b-a3b"], want).gib()
    assert set(printed) == {"step_peak", *bmem.STEP_TERMS}
    for k, v in printed.items():
        assert v == pytest.approx(g["peak" if k == "step_peak" else k], rel=1e-3, abs=1e-4), k
    # and the default settings are not what it printed (each flag above moves some term)
    assert printed["peak_reserved"] != pytest.approx(plan_step(MOE_SHAPES["qwen3-30b-a3b"]).gib()["peak_reserved"])


def test_default_allowances_are_read_off_the_fit_record_alone():
    from qerl.bench import memory_fit as mf

    step = mf.select(mf.load_steps(STEP), f"{FIT_RECORD['case']}@{FIT_RECORD['commit']}")
    assert (step.peak_allocated, step.peak_reserved) == (FIT_RECORD["peak_allocated"], FIT_RECORD["peak_reserved"])
    assert mf.fit(step) == replace(DEFAULT_ALLOWANCES, capped_slack=None, capped_fit_on="")


CAPPED_FIT = f"{CAPPED_FIT_RECORD['case']}@{CAPPED_FIT_RECORD['commit']}"
# the other capped MoE records: bf16 KV beside the fit's fp8 (same commit), and another shape under another cap
CAPPED_OUT = ["qwen3-30b-a3b nvfp4 8x8 prompt256 new256 mu1 mb2 ckpt chunk128 kv1.2 adamw_8bit cap22GiB "
              "no-humming@b8030c1",
              "gpt-oss-20b nvfp4 8x8 prompt256 new256 mu1 mb2 ckpt chunk128 kv0.5 kv-fp8 adamw_8bit cap14GiB "
              "no-humming echunk128mib embed4bit@9b635f0"]


def test_default_capped_slack_is_the_capped_fit_records_reserved_over_allocated():
    """The capped slack is the capped record's measured reserved - allocated, read back from step.jsonl; the
    residual and the uncapped slack stay FIT_RECORD's."""
    from qerl.bench import memory_fit as mf

    step = mf.select(mf.load_steps(STEP), CAPPED_FIT)
    assert (step.peak_allocated, step.peak_reserved) == (CAPPED_FIT_RECORD["peak_allocated"],
                                                         CAPPED_FIT_RECORD["peak_reserved"])
    assert mf.settings_of_case(step.case, step.commit)[1].memory_cap_gb == 22.0
    assert DEFAULT_ALLOWANCES.capped_slack == round((_measured(step.case, "peak_reserved", step.commit)
                                                     - _measured(step.case, "peak_allocated", step.commit)) * GIB)
    fit = mf.select(mf.load_steps(STEP), f"{FIT_RECORD['case']}@{FIT_RECORD['commit']}")
    assert mf.fit_capped(step, mf.fit(fit)) == DEFAULT_ALLOWANCES
    assert DEFAULT_ALLOWANCES.capped_fit_on == CAPPED_FIT


def test_the_capped_slack_moves_capped_predictions_only():
    """A cap moves no term: an uncapped setting's prediction ignores the capped slack, a capped one's moves by
    exactly its change; with no capped slack known, a capped setting gets the uncapped one."""
    shape, a = MOE_SHAPES["qwen3-30b-a3b"], DEFAULT_ALLOWANCES
    b = replace(a, capped_slack=a.capped_slack + 123 * 2**20)
    free, capped = StepSettings(), StepSettings(memory_cap_gb=22.0)
    assert plan_step(shape, free, b).peak_reserved == plan_step(shape, free, a).peak_reserved
    assert plan_step(shape, capped, b).peak_reserved - plan_step(shape, capped, a).peak_reserved == 123 * 2**20
    assert plan_step(shape, capped, a).peak_allocated == plan_step(shape, free, a).peak_allocated
    unknown = replace(a, capped_slack=None)
    assert plan_step(shape, capped, unknown).peak_reserved == plan_step(shape, free, a).peak_reserved


@pytest.mark.parametrize("predicted", CAPPED_OUT)
def test_two_fits_predict_the_other_capped_steps_within_5_percent(predicted):
    """Out of sample: the allowances off FIT_RECORD, the capped slack off CAPPED_FIT_RECORD, each other capped
    record predicted (at writing: +4.43 % and +1.22 %; +7.52 % and +5.58 % with the uncapped slack)."""
    from qerl.bench import memory_fit as mf

    steps = mf.load_steps(STEP)
    allow = mf.fit_capped(mf.select(steps, CAPPED_FIT), mf.fit(mf.select(steps, FULL_DEPTH[0])))
    p = mf.predict(mf.select(steps, predicted), allow)
    assert p.metric == "peak_reserved" and abs(p.error_pct) <= 5, (p.predicted, p.measured)


def test_fit_capped_on_refuses_an_uncapped_record_and_predicts_neither_fit(capsys):
    from qerl.bench import memory_fit as mf

    with pytest.raises(SystemExit, match="names no memory cap"):
        mf.run(FULL_DEPTH[0], [], [], STEP, log=lambda *_: None, fit_capped_on=FULL_DEPTH[1])
    allow, preds = mf.run(FULL_DEPTH[0], [], [], STEP, fit_capped_on=CAPPED_FIT)
    names = {p.step.name for p in preds}
    assert FULL_DEPTH[0] not in names and CAPPED_FIT not in names and set(CAPPED_OUT) <= names
    assert "capped allocator slack 0.524" in capsys.readouterr().out


def test_a_prediction_depends_on_the_fit_record_only():
    """Changing the predicted step's measured peaks moves no prediction; changing the fit record's moves it by as
    much (the residual is allocated bytes, the slack reserved over allocated)."""
    from qerl.bench import memory_fit as mf

    steps = mf.load_steps(STEP)
    base, other = (mf.select(steps, s) for s in FULL_DEPTH)
    p = mf.predict(other, mf.fit(base))
    changed = replace(other, peak_allocated=other.peak_allocated + 3, peak_reserved=other.peak_reserved + 5)
    assert mf.predict(changed, mf.fit(base)).predicted == p.predicted
    assert mf.predict(changed, mf.fit(base)).measured == p.measured + 5
    moved = replace(base, peak_allocated=base.peak_allocated + 0.5, peak_reserved=base.peak_reserved + 0.75)
    assert mf.predict(other, mf.fit(moved)).predicted == pytest.approx(p.predicted + 0.75, abs=1e-6)


def test_case_names_read_back_as_the_settings_bench_step_ran():
    """The settings a record's case names are those of the flags that made it: bench/step.py case_name of a
    namespace with those flags, read back by memory_fit.settings_of_case."""
    import argparse

    from qerl.bench.memory_fit import settings_of_case
    from qerl.bench.step import case_name

    ns = argparse.Namespace(shape="qwen3-30b-a3b", layers=None, prompts=8, num_generations=8, prompt_len=256,
                            max_new_tokens=256, num_iterations=1, micro_batch=1, gradient_checkpointing=True,
                            logprob_chunk=128, kv_cache_gb=0.5, kv_fraction=None, optim="adamw_8bit",
                            memory_cap_gb=22.0, lengths="max", max_staleness=0, moe_path="fast", humming=False,
                            humming_storage=False, steps=1)
    shape, st = settings_of_case(case_name(ns, "nvfp4"))
    assert shape == MOE_SHAPES["qwen3-30b-a3b"]
    assert st == StepSettings(micro_batch=1, logprob_chunk=128, kv_cache_gb=0.5, optim="adamw_8bit", humming=False,
                              memory_cap_gb=22.0)


def test_candidate_commands_run_the_settings_predicted():
    """Each candidate's `python -m qerl.bench.step` line, through bench step's own case name, is the candidate."""
    import argparse
    import shlex

    from qerl.bench.memory_fit import settings_of_case
    from qerl.bench.step import case_name
    from qerl.bench.step_candidates import candidates, step_command

    shape = MOE_SHAPES["qwen3-30b-a3b"]
    found = candidates(shape, StepSettings(humming=False, optim="adamw_8bit"), 22, 1.0)
    assert found and all(c.peak_gib <= 21 and c.settings.memory_cap_gb == 22 for c in found)
    # predicted as run: under the cap, with the capped slack
    assert all(plan_step(shape, c.settings).allocator_slack == DEFAULT_ALLOWANCES.capped_slack for c in found)
    fp8 = [c for c in found if c.settings.kv_bytes == 1]
    assert fp8, "an fp8 KV candidate: the grid has it, bench step runs it"
    for c in found[:3] + fp8[:2]:
        argv = shlex.split(step_command(shape, c.settings))
        assert argv[:3] == ["python", "-m", "qerl.bench.step"] and "--record" in argv
        flags = dict(zip(argv[3::2], argv[4::2]))  # flag, value pairs (the switches come last)
        ns = argparse.Namespace(shape=flags["--shape"], layers=None, prompts=int(flags["--prompts"]),
                                num_generations=int(flags["--num-generations"]), prompt_len=int(flags["--prompt-len"]),
                                max_new_tokens=int(flags["--max-new-tokens"]), num_iterations=1,
                                micro_batch=int(flags["--micro-batch"]), gradient_checkpointing=True,
                                logprob_chunk=int(flags["--logprob-chunk"]), kv_cache_gb=float(flags["--kv-cache-gb"]),
                                kv_fraction=None, optim=flags["--optim"], memory_cap_gb=22.0, lengths="max",
                                kv_cache_dtype=flags.get("--kv-cache-dtype", "auto"),
                                max_staleness=0, moe_path="fast", humming="--no-humming" not in argv,
                                humming_storage=False, steps=int(flags["--steps"]))
        assert settings_of_case(case_name(ns, "nvfp4"))[1] == c.settings


def test_bench_memory_fit_on_prints_the_out_of_sample_prediction(capsys):
    bmem.main(["--fit-on", FULL_DEPTH[0], "--predict", FULL_DEPTH[1]])
    out = capsys.readouterr().out
    row = [x for x in out.splitlines() if x.startswith("gpt-oss-120b nvfp4")]
    assert len(row) == 1 and row[0].split()[-5] == "peak_reserved" and row[0].split()[-1] == "yes"
    assert "residual" in out and "slack" in out


def test_a_candidates_command_keeps_its_expert_chunk_and_4bit_embedding():
    """step_command of the gpt-oss-20b 14 GiB recipe's settings: the flags bench step reads back to the same
    settings (the expert chunk as MiB, the embedding in 4 bits, the cap)."""
    import argparse
    import shlex

    from qerl.bench import memory_fit as mf
    from qerl.bench.step import case_name
    from qerl.bench.step_candidates import step_command
    from qerl.bench.step_plan import FITS_RECORDS

    step = mf.select(mf.load_steps(STEP), FITS_RECORDS["gpt-oss-20b"])
    shape, st = mf.settings_of_case(step.case)
    argv = shlex.split(step_command(shape, st))
    assert "--embed-4bit" in argv and "--expert-chunk-mib" in argv
    flag = lambda f: argv[argv.index(f) + 1]  # noqa: E731
    ns = argparse.Namespace(shape=flag("--shape"), layers=None, prompts=int(flag("--prompts")),
                            num_generations=int(flag("--num-generations")), prompt_len=int(flag("--prompt-len")),
                            max_new_tokens=int(flag("--max-new-tokens")), num_iterations=1,
                            micro_batch=int(flag("--micro-batch")), gradient_checkpointing=True,
                            logprob_chunk=int(flag("--logprob-chunk")), kv_cache_gb=float(flag("--kv-cache-gb")),
                            kv_fraction=None, optim=flag("--optim"), memory_cap_gb=float(flag("--memory-cap-gb")),
                            lengths="max", kv_cache_dtype=flag("--kv-cache-dtype"), max_staleness=0, moe_path="fast",
                            humming="--no-humming" not in argv, humming_storage=False,
                            expert_chunk_mib=int(flag("--expert-chunk-mib")), embed_4bit=True, steps=1)
    assert mf.settings_of_case(case_name(ns, "nvfp4"))[1] == st
