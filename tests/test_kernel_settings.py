"""KernelSettings (one object for every kernel choice) and the per-weight state cache."""

import gc
import threading

import pytest
import torch

from qerl.formats import get_format
from qerl.kernels import dispatch, settings
from qerl.kernels.weight_state import WeightState
from qerl.layers.fused_group import members_one_by_one
from qerl.layers.qlora_linear import unfused_lora


def test_use_scopes_changes_and_restores_them_on_exit_and_on_error():
    base = settings.current()
    with settings.use(kernels=False, wgmma=True) as ks:
        assert ks is settings.current() and not ks.kernels and ks.wgmma
        with settings.use(fuse_lora=False):
            assert not settings.current().fuse_lora and not settings.current().kernels  # nested: inherits
        assert settings.current().fuse_lora
    assert settings.current() == base
    with pytest.raises(RuntimeError):
        with settings.use(train_fused=False):
            raise RuntimeError("boom")
    assert settings.current() == base


def test_layer_contexts_are_settings_scopes():
    with unfused_lora():
        assert not settings.current().fuse_lora
    with members_one_by_one():
        assert not settings.current().train_fused
    assert settings.current().fuse_lora and settings.current().train_fused


def test_a_thread_keeps_its_own_settings():
    seen = {}
    inside, release = threading.Event(), threading.Event()

    def worker():
        seen["start"] = settings.current()
        with settings.use(fold_and_pack=False):
            inside.set()
            release.wait(5)
            seen["worker"] = settings.current().fold_and_pack

    with settings.use(kernels=False):
        t = threading.Thread(target=worker)
        t.start()
        inside.wait(5)
        assert settings.current().fold_and_pack and not settings.current().kernels  # the worker's scope is its own
        release.set()
        t.join()
    assert seen["start"] == settings.KernelSettings() and seen["worker"] is False


def test_kernels_off_takes_the_torch_path(monkeypatch):
    calls = []
    fake = dispatch.Backend("fake", lambda x, fmt: True, lambda *a, **k: calls.append(1) or torch.zeros(2, 8),
                            lambda *a: None)
    monkeypatch.setattr(dispatch, "_BACKENDS", [fake])
    fmt = get_format("nvfp4")
    w = torch.randn(8, 16)
    t = fmt.quantize(w)
    x = torch.randn(2, 16)
    dispatch.base_matmul(x, fmt, t, (8, 16))
    assert calls == [1]
    with settings.use(kernels=False):
        y = dispatch.base_matmul(x, fmt, t, (8, 16))
    assert calls == [1]
    torch.testing.assert_close(y, x @ fmt.dequantize(t, (8, 16), torch.float32).T)


def test_weight_state_builds_once_per_live_tensor_and_forgets_dead_ones():
    cache = WeightState()
    a = torch.zeros(4)
    builds = []
    assert cache.get(a, lambda: builds.append("a") or 1) == 1
    assert cache.get(a, lambda: builds.append("again") or 2) == 1 and builds == ["a"]
    b = torch.zeros(4)
    assert cache.get(b, lambda: 3) == 3 and len(cache) == 2
    del a
    gc.collect()
    assert len(cache) == 1  # the dead tensor's entry went with it


def test_engine_and_trainer_run_under_their_own_settings(tmp_path, monkeypatch):
    from test_trainer import _trainer

    from qerl.rollout import Engine, SamplingParams

    want = settings.KernelSettings(fold_and_pack=False, wgmma=True)
    tr = _trainer(tmp_path / "run", max_steps=1)
    tr.kernel_settings = want  # as if passed to the constructor (what the engine got there is checked below)
    seen = []
    real = dispatch.base_matmul
    monkeypatch.setattr(dispatch, "base_matmul", lambda *a, **k: seen.append(settings.current()) or real(*a, **k))
    tr.train_step()
    assert seen and all(s.fold_and_pack is False and s.wgmma for s in seen[:3])  # the rollout's and the update's
    assert settings.current() == settings.KernelSettings()  # nothing leaks out of the step
    seen.clear()
    eng = Engine(tr.model, tr.tok, max_len=32, max_slots=2, kernel_settings=settings.KernelSettings(kernels=False))
    eng.generate([[5, 6, 7]], n=1, params=SamplingParams(max_new_tokens=2, seed=0))
    assert seen and all(not s.kernels for s in seen)
