"""kernels/experts_path.py: the one choice of an MoE experts' path, read by QuantExperts and the engine.
The rules checked here are the ones QuantExperts ran before the choice moved (GEMV for no-grad decode
batches where it is on, else grouped on CUDA or where a module forces it, else the loop), at the
boundaries of the token table (kernels/m_thresholds.py)."""

import pytest
import torch

pytest.importorskip("triton")
from qerl.formats import get_format  # noqa: E402
from qerl.kernels import moe_gemv, settings  # noqa: E402
from qerl.kernels.experts_path import GEMV, GROUPED, LOOP, experts_path, gemv_max_tokens  # noqa: E402
from qerl.kernels.m_thresholds import MOE_GEMV_MAX_TOKENS  # noqa: E402
from qerl.layers.quant_experts import QuantExperts  # noqa: E402

NVFP4 = get_format("nvfp4")


@pytest.fixture
def interpreter(monkeypatch):
    """CPU tensors count as the GEMV's device (Triton's interpreter): the choice, not the kernel, is tested."""
    monkeypatch.setattr(moe_gemv, "RUN_ON_CPU_INTERPRETER", True)


def _x(t):
    return torch.zeros(t, 64)


def test_decode_batches_take_the_gemv_up_to_the_table_bound(interpreter):
    with torch.no_grad():
        assert experts_path(_x(1), NVFP4) == GEMV
        assert experts_path(_x(MOE_GEMV_MAX_TOKENS), NVFP4) == GEMV
        assert experts_path(_x(MOE_GEMV_MAX_TOKENS + 1), NVFP4) == LOOP  # the CPU: no grouped path
        assert experts_path(_x(MOE_GEMV_MAX_TOKENS + 1), NVFP4, grouped=True) == GROUPED
        with settings.use(moe_gemv=False):
            assert experts_path(_x(1), NVFP4) == LOOP
        with settings.use(kernels=False):
            assert experts_path(_x(1), NVFP4) == LOOP
    assert experts_path(_x(1), NVFP4) == LOOP  # autograd on: the GEMV has no backward
    with torch.no_grad():  # a format the GEMV does not decode
        assert experts_path(_x(1), get_format("nf4")) == LOOP


def test_without_the_interpreter_the_cpu_runs_the_loop_unless_a_module_forces_grouped():
    with torch.no_grad():
        assert experts_path(_x(1), NVFP4) == LOOP
        assert experts_path(_x(1), NVFP4, grouped=True) == GROUPED
        with settings.use(moe_grouped=True):
            assert experts_path(_x(300), NVFP4) == LOOP  # grouped by the settings is for CUDA only


def test_the_engine_bounds_its_moe_graphs_by_the_gemv_choice():
    assert gemv_max_tokens(settings.KernelSettings()) == MOE_GEMV_MAX_TOKENS == moe_gemv.MAX_TOKENS
    assert gemv_max_tokens(settings.KernelSettings(moe_gemv=False)) == 0
    assert gemv_max_tokens(settings.KernelSettings(kernels=False)) == 0


def test_quant_experts_runs_the_path_chosen(interpreter, monkeypatch):
    """The layer follows experts_path: each path's method is called exactly where the choice names it."""
    g = torch.Generator().manual_seed(0)
    q = QuantExperts.quantize(torch.randn(3, 32, 64, generator=g) * 0.1, torch.randn(3, 64, 16, generator=g) * 0.1,
                              "nvfp4", lambda y: y[..., :16] * y[..., 16:], torch.float32)
    ran = []
    for name in ("_gemv_forward", "_grouped_forward"):
        monkeypatch.setattr(q, name, lambda h, i, w, name=name: ran.append(name) or torch.zeros_like(h))
    idx, wts = torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1)
    with torch.no_grad():
        q(_x(2), idx, wts)
        q.grouped = True
        with settings.use(moe_gemv=False):
            q(_x(2), idx, wts)
        q.grouped = None
        with settings.use(moe_gemv=False):
            y = q(_x(2), idx, wts)  # the loop: a real output
    assert ran == ["_gemv_forward", "_grouped_forward"] and y.shape == (2, 64)
