"""An MoE decode step is capturable in a CUDA graph where the grouped GEMV runs it: no op that reads a
device value back to the host (item / tolist, nonzero, a boolean-mask index, bincount, ...). Checked on
the CPU by watching every aten op of the engine's decode step (Triton's interpreter runs the GEMV), with
the loop as the control that does sync; and the runner's graph bound (ModelRunner.graphed)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qerl.kernels import moe_gemv, moe_route, settings
from qerl.model import load_policy
from qerl.rollout import Engine
from qerl.rollout.forward import decode, prefill

if torch.cuda.is_available():  # a GPU machine runs Triton for real: the CPU tensors here need its interpreter
    pytest.skip("checks the CPU interpreter's decode; on a GPU the graph tests (test_moe_gpu.py, "
                "test_moe_lora_kernel_gpu.py) prove capture", allow_module_level=True)

SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "bincount", "unique", "_unique", "_unique2",
           "unique_consecutive", "unique_dim", "equal", "is_nonzero"}


class _Syncs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        bool_index = name == "index" and any(isinstance(t, torch.Tensor) and t.dtype == torch.bool
                                             for t in (args[1] if len(args) > 1 else []) if t is not None)
        no_size = name == "repeat_interleave" and "output_size" not in (kwargs or {})
        if name in SYNCING or bool_index or no_size:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def engine(request, tmp_path, monkeypatch):
    monkeypatch.setattr(moe_gemv, "RUN_ON_CPU_INTERPRETER", True)
    monkeypatch.setattr(moe_route, "RUN_ON_CPU_INTERPRETER", True)  # the default route, one Triton launch
    if request.param == "gpt_oss":
        from test_gpt_oss import write_stock_mxfp4

        write_stock_mxfp4(tmp_path)
    else:
        from test_moe_experts import tiny_moe

        tiny_moe(request.param).save_pretrained(tmp_path)
    pol = load_policy(str(tmp_path), "nvfp4", lora_rank=4, target_modules=["q", "k", "v", "o", "experts"],
                      dtype=torch.float32, progress=False)
    return Engine(pol.model, max_len=128, max_slots=4, kv_cache_gb=0.01)


def _decode_ops(eng, gemv: bool) -> list[str]:
    run, dev = eng.runner, eng.view.device
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 0]])
    pos = torch.tensor([4, 3])
    with torch.no_grad(), settings.use(moe_gemv=gemv):
        prefill(eng.view, eng.cache, ids, pos, [[0], [1]], run.rope)
        with _Syncs() as watch:
            decode(eng.view, eng.cache, torch.tensor([3, 4], device=dev), pos, 2, 128, run.rope, run.ops,
                   run.fused_attention)
    return watch.seen


@pytest.mark.parametrize("engine", ["qwen3_moe", "gpt_oss"], indirect=True)
def test_decode_reads_nothing_back_with_the_gemv(engine):
    assert _decode_ops(engine, gemv=True) == []
    assert _decode_ops(engine, gemv=False)  # the loop lists its hit experts on the host: the control


@pytest.mark.parametrize("engine", ["qwen3_moe"], indirect=True)
def test_moe_graphs_are_bounded_by_the_gemv(engine):
    run = engine.runner
    assert run.graph_max_batch == moe_gemv.MAX_TOKENS
    run.cuda_graphs = True  # as Engine(cuda_graphs=True) asks on a GPU
    assert run.graphed(moe_gemv.MAX_TOKENS) and not run.graphed(moe_gemv.MAX_TOKENS + 1)
    with settings.use(moe_gemv=False):
        assert Engine(engine.model, max_len=128, max_slots=4, kv_cache_gb=0.01).runner.graph_max_batch == 0
