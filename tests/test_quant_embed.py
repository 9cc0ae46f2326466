"""The 4-bit input embedding (layers/quant_embed.py, TrainConfig.embed_4bit): a lookup gives NVFP4's dequantized
rows of the table, the model's forward and the engine's rollouts read them as an nn.Embedding holding the
dequantized table would, a tied model is refused, Gemma's scale is kept, the state dict keeps stock names,
a run trains with it under the parity gate, and the memory model prices the table as the module holds it."""

from dataclasses import replace

import pytest
import torch
from torch import nn

from cli_runs import train_args
from qerl.bench.step_plan import MOE_SHAPES, StepSettings, plan_step
from qerl.formats import get_format
from qerl.layers.quant_embed import QuantEmbedding, quantize_embedding
from qerl.model import random_policy
from qerl.rollout import Engine, SamplingParams
from tiny_models import config

G = torch.Generator().manual_seed(0)


def _embedding(v=96, d=64, dtype=torch.float32):
    emb = nn.Embedding(v, d, dtype=dtype)
    with torch.no_grad():  # rows of different magnitudes, so the 16-wide groups get different scales
        emb.weight.copy_(torch.randn(v, d, generator=G) * torch.rand(v, 1, generator=G))
    return emb


def test_a_lookup_gives_the_nvfp4_rows_of_the_table():
    emb = _embedding()
    q = QuantEmbedding.from_embedding(emb)
    fmt = get_format("nvfp4")
    table = fmt.dequantize(fmt.quantize(emb.weight), tuple(emb.weight.shape), torch.float32)  # the reference
    ids = torch.randint(0, 96, (3, 7), generator=G)
    assert torch.equal(q(ids), table[ids])
    assert torch.equal(q.weight, table)
    # model.to(dtype) moves the rows' dtype with it (the packed bytes stay)
    q.to(torch.bfloat16)
    assert q(ids).dtype == torch.bfloat16 and torch.equal(q(ids), table[ids].to(torch.bfloat16))
    assert q.weight_packed.dtype == torch.uint8
    # the 4-bit rounding of the table, not the table
    rel = float((table - emb.weight).detach().norm() / emb.weight.detach().norm())
    assert 0 < rel < 0.15
    # a quarter of the bf16 table's bytes and a little: packed codes and one FP8 scale per 16
    held = sum(b.numel() * b.element_size() for n, b in q.named_buffers() if n.startswith("weight_"))
    assert held == 96 * 64 // 2 + 96 * 64 // 16 + 4


def _policy(seed=0):
    torch.manual_seed(seed)
    return random_policy(config("qwen2"), "nvfp4", lora_rank=4, device="cpu", dtype=torch.float32, std=0.08,
                         progress=False)


def test_the_model_and_the_engine_read_the_rows_an_embedding_of_the_dequantized_table_gives():
    quant, ref = _policy(), _policy()
    q = quantize_embedding(quant.model)
    assert quant.model.get_input_embeddings() is q and quantize_embedding(quant.model) is q
    with torch.no_grad():
        ref.model.get_input_embeddings().weight.copy_(q.weight)
    ids = torch.randint(3, 160, (2, 11), generator=G)
    with torch.no_grad():  # transformers' own forward over both
        assert torch.allclose(quant.model(ids).logits, ref.model(ids).logits, rtol=0, atol=1e-6)
    prompts = [[5, 9, 14, 20], [7, 3, 30]]
    p = SamplingParams(max_new_tokens=8, greedy=True, ignore_eos=True)
    out_q = Engine(quant.model, max_len=64, max_slots=4).generate(prompts, n=2, params=p)
    out_r = Engine(ref.model, max_len=64, max_slots=4).generate(prompts, n=2, params=p)
    assert [o.token_ids for o in out_q] == [o.token_ids for o in out_r]
    # the state dict keeps the stock name, holding the dequantized table, so writers emit what transformers reads
    sd = quant.model.state_dict()
    assert set(sd) == set(ref.model.state_dict())
    assert torch.equal(sd["model.embed_tokens.weight"], q.weight)


def test_a_tied_model_and_an_unknown_embedding_are_refused():
    torch.manual_seed(0)
    tied = random_policy(config("qwen2", tie_word_embeddings=True), "nvfp4", lora_rank=2, device="cpu",
                         dtype=torch.float32, progress=False)
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        quantize_embedding(tied.model)

    class Odd(nn.Embedding):
        pass

    with pytest.raises(ValueError, match="Odd"):
        QuantEmbedding.from_embedding(Odd(32, 16))


def test_gemmas_scaled_embedding_keeps_its_scale():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    scaled = Gemma3TextScaledWordEmbedding(64, 32, padding_idx=0, embed_scale=32 ** 0.5)
    with torch.no_grad():
        scaled.weight.normal_(0, 0.3, generator=G)
    q = QuantEmbedding.from_embedding(scaled)
    with torch.no_grad():
        scaled.weight.copy_(q.weight)  # the reference: transformers' module over the dequantized table
    ids = torch.randint(0, 64, (4, 5), generator=G)
    assert torch.allclose(q(ids), scaled(ids), rtol=0, atol=1e-6)


def test_the_memory_model_prices_the_table_as_the_module_holds_it():
    # gpt-oss-20b's layout at a vocabulary small enough to build here
    s = replace(MOE_SHAPES["gpt-oss-20b"], vocab=1024, hidden=256)
    emb = _embedding(s.vocab, s.hidden, torch.bfloat16)
    q = QuantEmbedding.from_embedding(emb)
    held = sum(b.numel() * b.element_size() for n, b in q.named_buffers() if n.startswith("weight_"))
    bf16 = emb.weight.numel() * emb.weight.element_size()
    plain, four = plan_step(s, StepSettings()), plan_step(s, StepSettings(embed_4bit=True))
    assert plain.dense - four.dense == bf16 - held
    assert plain.peak_allocated - four.peak_allocated == bf16 - held


def test_a_run_trains_with_the_4bit_embedding_and_the_parity_gate_on(cli, model, tmp_path, monkeypatch):
    import qerl.layers.quant_embed as qe

    made = []
    monkeypatch.setattr(qe, "quantize_embedding", lambda m, *a: made.append(quantize_embedding(m, *a)) or made[-1])
    rc, out, err = cli(*train_args(model, tmp_path / "run", "--embed_4bit", "true", "--parity_check_steps", "1",
                                   "--max_steps", "1"))
    assert rc == 0, err
    assert (tmp_path / "run" / "checkpoint-1").is_dir()
    assert len(made) == 1 and isinstance(made[0], QuantEmbedding)


def test_rows_in_chunks_equal_rows_at_once(monkeypatch):
    import qerl.layers.quant_embed as qe

    q = QuantEmbedding.from_embedding(_embedding())
    ids = torch.randint(0, 96, (3, 7), generator=G)
    whole = q(ids)
    monkeypatch.setattr(qe, "ROWS_AT_ONCE", 5)  # 21 ids: four chunks of 5 and one of 1
    assert torch.equal(q(ids), whole)


def test_with_a_4bit_head_the_embedding_is_quantized_without_dequantizing_the_head(monkeypatch):
    from qerl.layers.quant_head import QuantHead, quantize_lm_head

    pol = _policy()
    quantize_lm_head(pol.model)
    made = []
    real = QuantHead.weight.fget
    monkeypatch.setattr(QuantHead, "weight", property(lambda self: made.append(1) or real(self)))
    quantize_embedding(pol.model)
    assert isinstance(pol.model.get_input_embeddings(), QuantEmbedding) and not made
