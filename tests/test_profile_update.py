"""scripts/profile_update.py (issue 59, the MoE update's profile): its kernel kinds and phases, and a CPU run."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "profile_update.py"


@pytest.fixture(scope="module")
def pu():
    spec = importlib.util.spec_from_file_location("profile_update", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_kernel_names_sort_into_kinds(pu):
    c = pu.classify
    assert c("_dequant_experts_kernel", "forward") == pu.DEQ
    assert c("_dequant_experts_kernel", "recompute") == pu.DEQ
    # torch._grouped_mm's CUTLASS kernel says cutlass too: grouped wins over the dense GEMMs
    cutlass = ("void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::"
               "GemmUniversal<cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int> >, ...>>>")
    assert c(cutlass, "forward") == pu.GMM
    assert c("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NTN", "backward", op="aten::_grouped_mm") == pu.GMM
    assert c("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NTN", "backward") == pu.DENSE
    assert c("aten::_grouped_mm", "recompute") == pu.GMM  # the CPU's op names
    assert c("w4_wgmma_kernel", "forward") == pu.DENSE
    assert c("triton_tem_fused_0", "forward") == pu.ATTN
    assert c("flash_fwd_kernel", "recompute") == pu.ATTN
    assert c("void at::native::vectorized_elementwise_kernel<4, ...>", "backward") == pu.ELEM
    # the optimizer's phase decides, whatever the kernel; its own names outside it too
    assert c("void at::native::vectorized_elementwise_kernel<4, ...>", "optimizer") == pu.OPT
    assert c("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "backward") \
        == pu.OPT
    # after the decoder layers (forward) or before their backward: the logits
    assert c("nvjet_tst_128x256", "forward", region="head") == pu.HEAD
    assert c("some_new_kernel", "forward") == pu.OTHER


def test_phase_and_region_by_markers(pu):
    ranges = {pu.M_FWD: [(0, 100)], pu.M_BWD: [(110, 300)], pu.M_OPT: [(310, 320)],
              # two layers' forward calls, then their recomputes in the backward (last layer first)
              pu.M_LAYER: [(10, 40), (45, 80), (150, 180), (230, 260)]}
    place = pu.placer(ranges)
    assert place(5) == ("forward", "pre")        # the embedding
    assert place(20) == ("forward", "layer")
    assert place(90) == ("forward", "head")      # final norm, lm_head chunks, loss
    assert place(120) == ("backward", "head")    # the loss and logits backward come first
    assert place(160) == ("recompute", "layer")  # a layer's forward again inside the backward
    assert place(200) == ("backward", "layer")
    assert place(240) == ("recompute", "layer")
    assert place(315) == ("optimizer", "layer")
    assert place(305) is None
    t = pu.tally([("k_dequant_experts", 3.0, 20, ""), ("k_dequant_experts", 4.0, 160, ""),
                  ("nvjet_x", 5.0, 120, ""), ("nvjet_x", 2.0, 200, ""), ("adam", 1.0, 315, "")], ranges, 2, 8)
    dq = t["kinds"][pu.DEQ]
    assert (dq["forward"], dq["recompute"], dq["backward"]) == (3.0, 4.0, 0.0)
    assert dq["us_full"] == pytest.approx(7.0 * 4)  # in the layers: scaled to the full depth
    assert t["kinds"][pu.HEAD]["us_full"] == 5.0       # the logits are not
    assert t["phases"] == {"forward": 3.0, "recompute": 4.0, "backward": 7.0, "optimizer": 1.0}


def test_cpu_run_writes_the_profile(pu, tmp_path):
    rc = pu.main(["--shape", "qwen3-moe-tiny", "--layers", "1", "--micro-batches", "1,2", "--prompts", "1",
                  "--num-generations", "4", "--prompt-len", "8", "--completion-len", "8", "--warmup", "1",
                  "--iters", "1", "--device", "cpu", "--out", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "profile_update.json").read_text())
    assert res["device"] == "cpu" and res["optim"].startswith("adamw") and res["measured_update_s"] == 34.6
    assert [r["micro_batch"] for r in res["sizes"]] == [1, 2]
    for r in res["sizes"]:
        for k in ("ms_forward", "ms_backward", "ms_fwd_bwd", "ms_optimizer", "tok_s_built", "ms_fwd_bwd_full",
                  "update_s_full", "tok_s_full", "kinds", "phases", "top_kernels"):
            assert k in r, k
        assert r["layers_built"] == 1 and r["layers_full"] == 2 and r["passes_per_step"] == 4 // r["micro_batch"]
        assert r["ms_forward"] > 0 and r["ms_backward"] > 0 and r["ms_optimizer"] > 0
        # checkpointing recomputes the layer in the backward; the experts run the grouped path
        assert r["phases"]["recompute"] > 0 and r["phases"]["backward"] > 0 and r["phases"]["optimizer"] > 0
        assert r["kinds"][pu.GMM]["forward"] > 0 and r["kinds"][pu.GMM]["recompute"] > 0
        assert r["kinds"][pu.GMM]["backward"] > 0
        assert pu.HEAD in r["kinds"] and pu.OPT in r["kinds"]
        assert 0 < len(r["top_kernels"]) <= 30
        assert r["host_syncs"] == 0 and r["sync_sites"] == []  # the CPU has none to count
        assert r["gpu_busy_pct"] != r["gpu_busy_pct"]  # NaN: no GPU
    txt = (tmp_path / "profile_update.txt").read_text()
    assert "grouped GEMM" in txt and "update s (full)" in txt
    assert (tmp_path / "profile_update.log").exists()


def test_a_host_sync_is_put_on_the_qerl_line_that_made_it(pu):
    """The site is the innermost frame in qerl's source; else the innermost frame outside torch; warnings'
    own frames and the hook never count."""
    import traceback

    def fs(path, line, name):
        return traceback.FrameSummary(path, line, name)

    src = pu.SRC
    stack = [fs("/x/scripts/profile_update.py", 10, "fwd_bwd"), fs(f"{src}/qerl/train/update.py", 88, "logprobs"),
             fs(f"{src}/qerl/layers/quant_experts.py", 223, "_grouped_forward"),
             fs("/venv/site-packages/torch/_tensor.py", 5, "tolist"), fs("/usr/lib/python3.12/warnings.py", 1, "warn"),
             fs("/x/scripts/profile_update.py", 99, "hook")]
    assert pu.stack_site(stack) == "qerl/layers/quant_experts.py:223 (_grouped_forward)"
    outside = [fs("/x/scripts/profile_update.py", 298, "fwd_bwd"), fs("/venv/site-packages/torch/autograd/g.py", 1, "b")]
    assert pu.stack_site(outside) == "profile_update.py:298 (fwd_bwd)"
    assert pu.stack_site([fs("/venv/lib/torch/x.py", 1, "f")]) == "(no Python frame)"


def test_host_syncs_counts_nothing_on_the_cpu(pu):
    import torch

    with pu.host_syncs(False) as sites:
        torch.ones(3).sum().item()
    assert not sites


def test_host_syncs_counts_each_sync_warning_by_site_and_restores_the_hooks(pu, monkeypatch):
    """The CUDA branch with torch's sync debug mode stubbed: each sync warning is counted at the line that
    raised it, other warnings still reach showwarning, and the mode and showwarning are restored."""
    import warnings

    import torch

    modes = []
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    shown = []
    monkeypatch.setattr(warnings, "showwarning", lambda *a, **k: shown.append(str(a[0])))
    before = warnings.showwarning
    with pu.host_syncs(True) as sites:
        for _ in range(3):
            warnings.warn("called a synchronizing CUDA operation")
        warnings.warn("something else entirely")
    assert modes == ["warn", 0]
    assert warnings.showwarning is before
    assert sum(sites.values()) == 3 and len(sites) == 1
    (site,) = sites
    assert site.startswith("test_profile_update.py:") and site.endswith("(test_host_syncs_counts_each_sync_warning_by_site_and_restores_the_hooks)")
    assert shown == ["something else entirely"]
