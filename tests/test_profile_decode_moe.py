"""scripts/profile_decode.py's MoE step (issue 59) on the CPU: the kind classifier, the bytes and weight-read
limit against a count of a tiny random MoE's own tensors, and the script end to end on a tiny shape."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("profile_decode", ROOT / "scripts" / "profile_decode.py")
pd = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pd)


def test_block_kinds_by_phase():
    names = ["nvjet_tst_64x8_64x16_1x1_v_bz_TNT", "void at::native::cunn_SoftMaxForward<8, float>",
             "void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>",
             "void at::native::vectorized_elementwise_kernel<4, DivFunctor>",
             "void at::native::vectorized_elementwise_kernel<4, clamp>",  # route: before its first sort
             "void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<...>",
             "void at::native::indexFuncSmallIndex<long, long>", "void at::native::vectorized_elementwise_kernel<4>",
             "_grouped_gemv_kernel", "_shrink_kernel", "_expand_kernel",
             "triton_poi_fused_mul_silu_0", "void at::native::index_elementwise_kernel<gather>",
             "_grouped_gemv_kernel", "_shrink_kernel", "_expand_kernel",
             "void at::native::index_elementwise_kernel<128, 4>", "void at::native::vectorized_elementwise_kernel<mul>",
             "void at::native::indexFuncLargeIndex<index_copy>", "void at::native::reduce_kernel<sum>"]
    got = pd.classify_block(names)
    assert got == [pd.ROUTER, pd.TOPK, pd.TOPK, pd.TOPK, pd.TOPK, pd.ROUTE, pd.ROUTE, pd.ROUTE,
                   pd.GEMV, pd.ELORA, pd.ELORA, pd.GATING, pd.GATHER, pd.GEMV, pd.ELORA, pd.ELORA,
                   pd.GATHER, pd.COMBINE, pd.GATHER, pd.COMBINE]


def test_step_kinds_markers_and_names():
    k = [("rope_kv_kernel", 1.0), ("split_kernel", 2.0), ("merge_kernel", 1.0), ("humming_gemm<...>", 5.0),
         ("shrink_kernel", 1.0), ("_expand_kernel", 1.0), ("triton_red_fused_rms_norm_0", 1.0),
         (pd.MARKER, 0.5), ("nvjet_router", 3.0), ("gatherTopK", 1.0), ("radixSortKVInPlace", 1.0),
         ("_grouped_gemv_kernel", 10.0), ("reduce_kernel<sum>", 1.0), (pd.MARKER, 0.5),
         ("nvjet_lm_head", 20.0), ("distribution_elementwise_grid_stride_kernel", 1.0), ("weird_kernel", 1.0)]
    rows, blocks = pd.classify_step(k)
    assert blocks == 1 and pd.MARKER not in [r[0] for r in rows]
    kinds = {n: kd for n, kd, _, _ in rows}
    assert [kinds[n] for n in ("rope_kv_kernel", "split_kernel", "merge_kernel")] == [pd.ATTN] * 3
    assert kinds["humming_gemm<...>"] == pd.W4 and kinds["shrink_kernel"] == pd.DLORA == kinds["_expand_kernel"]
    assert kinds["triton_red_fused_rms_norm_0"] == pd.NORMS
    assert (kinds["nvjet_router"], kinds["gatherTopK"], kinds["radixSortKVInPlace"]) == (pd.ROUTER, pd.TOPK, pd.ROUTE)
    assert kinds["_grouped_gemv_kernel"] == pd.GEMV and kinds["reduce_kernel<sum>"] == pd.COMBINE
    assert kinds["nvjet_lm_head"] == pd.HEAD and kinds["distribution_elementwise_grid_stride_kernel"] == pd.SAMPLE
    assert kinds["weird_kernel"] == pd.OTHER
    assert [r[3] for r in rows].count(True) == 5


def test_expected_hits():
    assert pd.expected_hits(128, 8, 1) == pytest.approx(8)
    assert pd.expected_hits(128, 8, 64) == pytest.approx(125.9, abs=0.05)  # moe_gemv's roofline figure


def test_bytes_against_the_model_tensors():
    """moe_step_bytes from the config equals the bytes of a random MoE's own tensors: all but the experts and
    the embedding in full, `hits` experts' share of the experts' (LoRA included), `batch` embedding rows."""
    from qerl.model import random_policy, shape_config
    from qerl.model.architectures import DEFAULT_TARGETS

    cfg = shape_config("qwen3-moe-tiny", 2)
    cfg.num_experts = 4  # hidden 64, 4 experts, top-2
    pol = random_policy(cfg, "nvfp4", lora_rank=4, target_modules=DEFAULT_TARGETS + ("experts",), device="cpu",
                        dtype=torch.float32, progress=False)
    batch, hits = 3, 2.5
    count = {"experts": 0, "other": 0, "embed": 0}
    for name, t in pol.model.state_dict(keep_vars=True).items():
        if ".experts." in name:
            count["experts"] += t.nbytes * hits / cfg.num_experts
        elif "embed_tokens" in name:
            count["embed"] += batch * t.shape[1] * t.element_size()
        else:
            count["other"] += t.nbytes
    b = pd.moe_step_bytes(cfg, batch, hits, "nvfp4", rank=4, expert_lora=True, elem=4, ctx=10)
    assert b[pd.GEMV] + b[pd.ELORA] == pytest.approx(count["experts"])
    assert b["embedding rows"] == count["embed"]
    weights = sum(v for k, v in b.items() if k != pd.ATTN)
    assert weights == pytest.approx(sum(count.values()))
    assert b[pd.ATTN] == 2 * batch * 2 * cfg.num_key_value_heads * cfg.head_dim * 10 * 4  # layers x K,V x keys
    assert pd.weight_limit(weights, 3e12, batch) == pytest.approx(batch * 3e12 / weights)
    no_lora = pd.moe_step_bytes(cfg, batch, hits, "nvfp4", rank=4, expert_lora=False, elem=4)
    assert no_lora[pd.ELORA] == 0 and no_lora[pd.GEMV] == b[pd.GEMV]


def test_script_end_to_end_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["profile_decode.py", "--shape", "qwen3-moe-tiny", "--layers", "2", "--quants",
                                      "nvfp4", "--batches", "2", "--skip-attention", "--device", "cpu",
                                      "--prompt-len", "16", "--new-tokens", "4", "--out", str(tmp_path)])
    pd.main()  # in this process: a subprocess would import torch and transformers again
    res = json.loads((tmp_path / "profile_decode_moe.json").read_text())["moe_step"][0]
    assert res["batch"] == 2 and res["layers_built"] == 2 and res["moe_blocks_marked"] == 2 * 8
    assert res["tok_s_full"] > 0 and res["weight_limit_tok_s"] > 0 and res["launches_per_moe_layer"] > 0
    assert len(res["top_kernels"]) > 0
    assert (tmp_path / "profile_decode_moe.txt").read_text().startswith("qwen3-moe-tiny")
