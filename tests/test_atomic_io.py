"""checkpoint/atomic.py and every writer that uses it: on an exception or a SIGKILL at each stage of
a save, the target keeps its previous content (or, killed after the commit, the complete new one),
and no temporary is left once the next start has run."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qerl.checkpoint import atomic

HERE = Path(__file__).parent
STAGES = ("writing", "written", "aside", "committed")


def snapshot(path: Path):
    """{relative file: sha256} of a folder, the sha256 of a file, None when missing."""
    if path.is_file():
        return hashlib.sha256(path.read_bytes()).hexdigest()
    if not path.exists():
        return None
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def debris(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if atomic.TMP in p.name or atomic.OLD in p.name)


def previous_folder(path: Path):
    shutil.rmtree(path, ignore_errors=True)
    path.unlink(missing_ok=True) if path.is_file() else None
    (path / "sub").mkdir(parents=True)
    (path / "old.txt").write_text("previous")
    (path / "sub" / "x.bin").write_bytes(b"\x00" * 100)


# ---- the writers under test: setup(root) -> (target, previous(), save(), next_start()) ------------


def _policy(root: Path):
    from tiny_models import save_tiny

    from qerl.model import load_policy, quantized_layers

    if not (root / "base").exists():
        save_tiny(root / "base", "llama")
    pol = load_policy(root / "base", "nvfp4", lora_rank=4, dtype=torch.float32, progress=False)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, layer in quantized_layers(pol.model):
            layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=g) * 0.05)
    return pol


def w_folder(root):
    target = root / "out"

    def save():
        with atomic.atomic_folder(target) as tmp:
            atomic.write_safetensors(tmp / "a.safetensors", atomic.entries({"a": torch.arange(4.0), "b": torch.ones(3)}))
            (tmp / "new.txt").write_text("new")
    return target, lambda: previous_folder(target), save, lambda: atomic.recover(target)


def w_file(root):
    target = root / "f.safetensors"

    def previous():
        target.write_bytes(b"previous")

    def save():
        atomic.atomic_file(target, lambda p: atomic.write_safetensors(p, atomic.entries({"a": torch.ones(2), "b": torch.zeros(2)})))
    return target, previous, save, lambda: atomic.recover(target)


def w_adapter(root):
    from qerl.checkpoint import save_adapter

    pol, target = _policy(root), root / "adapter"
    return target, lambda: previous_folder(target), lambda: save_adapter(pol, target), lambda: atomic.recover(target)


def w_compressed(root):
    from qerl.checkpoint import save_compressed

    pol, target = _policy(root), root / "ct"
    return target, lambda: previous_folder(target), lambda: save_compressed(pol, target), lambda: atomic.recover(target)


def w_export(root):
    from qerl.checkpoint import export_merged

    pol, target = _policy(root), root / "merged"
    # a small shard limit: the sharded path (several files and an index) is what gets interrupted
    save = lambda: export_merged(pol, target, dtype=torch.float32, max_shard_bytes=40_000)  # noqa: E731
    return target, lambda: previous_folder(target), save, lambda: atomic.recover(target)


def w_checkpoint(root):
    from qerl.train.run_folder import clean_temporaries
    from qerl.train.checkpoints import save_checkpoint

    pol = _policy(root)
    params = [p for p in pol.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    pol.model(torch.arange(8)[None]).logits.sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    run = root / "run"
    target = run / "checkpoint-3"

    def save():
        random.seed(0)  # the checkpoint holds the RNG states: the same in every attempt
        torch.manual_seed(0)
        save_checkpoint(run, 3, pol.model, opt, sched, {"data": {}})
    return target, lambda: previous_folder(target), save, lambda: clean_temporaries(run)


def w_metrics(root):
    from qerl.train.metrics import MetricsLog
    from qerl.train.run_folder import clean_temporaries

    run = root / "mrun"
    target = run / "metrics.jsonl"

    def previous():
        run.mkdir(exist_ok=True)
        target.write_text("".join(json.dumps({"step": s, "loss": s / 10}) + "\n" for s in range(5)))
    return target, previous, lambda: MetricsLog(run, report_to="none", resume_step=2), lambda: clean_temporaries(run)


WRITERS = {"folder": w_folder, "file": w_file, "adapter": w_adapter, "compressed": w_compressed, "export": w_export,
           "checkpoint": w_checkpoint, "metrics": w_metrics}


def kill_each_stage(name: str, root: str) -> None:
    """Run in a subprocess: for each stage, fork a child that saves and SIGKILLs itself there; the
    parent then runs the next start's recovery and prints what the target holds."""
    torch.set_num_threads(1)  # fork safety
    root = Path(root)
    target, previous, save, next_start = WRITERS[name](root)
    previous()
    before = snapshot(target)
    seq = []
    atomic.fault_hook = seq.append
    save()
    atomic.fault_hook = None
    after = snapshot(target)
    result = {"before": before, "after": after, "stages": {}}
    for stage in STAGES:
        previous()
        pid = os.fork()
        if pid == 0:
            # mid-file: the first tensor written; else the outermost save's stage (nested saves, e.g. a
            # checkpoint's adapter folder, pass the same stage earlier): its last occurrence
            nth = 1 if stage == "writing" else seq.count(stage)
            calls = []

            def die(s, stage=stage):
                calls.append(s)
                if s == stage and calls.count(s) == nth:
                    os.kill(os.getpid(), signal.SIGKILL)
            atomic.fault_hook = die
            try:
                save()
            finally:
                os._exit(0)  # the stage never came (a file writer has no "aside")
        _, status = os.waitpid(pid, 0)
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        had_debris = bool(debris(target.parent))
        next_start()
        result["stages"][stage] = {"killed": killed, "had_debris": had_debris, "state": snapshot(target),
                                   "debris": debris(target.parent)}
    print("RESULT " + json.dumps(result))


@pytest.mark.parametrize("name", list(WRITERS))
def test_sigkill_at_each_stage_leaves_previous_or_new_content_and_no_debris(name, tmp_path):
    code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_atomic_io as t; t.kill_each_stage({name!r}, {str(tmp_path)!r})"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    assert res["before"] != res["after"]  # else the test could not tell them apart
    killed = [s for s, r in res["stages"].items() if r["killed"]]
    for stage, r in res["stages"].items():
        want = res["after"] if stage == "committed" or not r["killed"] else res["before"]
        assert r["state"] == want, f"{name}: killed at {stage}"
        assert r["debris"] == [], f"{name}: killed at {stage}"
    assert {"written", "committed"} <= set(killed)
    if name not in ("file", "metrics"):  # folders: also killed mid-file and between the two renames
        assert {"writing", "aside"} <= set(killed)
        assert res["stages"]["aside"]["had_debris"]  # the moved-aside folder, put back by the next start


# a file is replaced in one rename (no "aside"); the metrics rewrite is text (no tensor is written)
_STAGES_OF = {"file": ("writing", "written"), "metrics": ("written",)}
_CASES = [(n, s) for n in ("folder", "file", "adapter", "export", "checkpoint", "metrics")
          for s in _STAGES_OF.get(n, ("writing", "written", "aside"))]


@pytest.mark.parametrize("name,stage", _CASES)
def test_an_exception_at_each_stage_leaves_the_previous_content_and_no_debris(name, stage, tmp_path, monkeypatch):
    target, previous, save, _ = WRITERS[name](tmp_path)
    previous()
    before = snapshot(target)

    def fail(s):
        if s == stage:
            raise RuntimeError(f"injected at {s}")
    monkeypatch.setattr(atomic, "fault_hook", fail)
    with pytest.raises(RuntimeError, match="injected"):
        save()
    assert snapshot(target) == before
    assert debris(tmp_path) == []


def test_a_save_into_an_existing_adapter_folder_keeps_its_other_files(tmp_path):
    from qerl.checkpoint import save_adapter

    pol = _policy(tmp_path)
    out = tmp_path / "adapter"
    out.mkdir()
    (out / "README.md").write_text("mine")
    save_adapter(pol, out)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "adapter_config.json", "adapter_model.safetensors",
                                                    "qerl_adapter.json"]
    assert (out / "README.md").read_text() == "mine"


def test_sharded_write_splits_and_indexes_every_tensor_exactly(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(50 + i, generator=g).to(dt)
               for i, dt in enumerate([torch.float32, torch.bfloat16, torch.float16, torch.float32])}
    tensors["u8"] = torch.arange(7, dtype=torch.uint8)
    names = atomic.write_sharded(tmp_path, atomic.entries(tensors), max_bytes=220)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(names) > 2 and names[-1] == "model.safetensors.index.json"
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for k, t in tensors.items():
        assert torch.equal(load_file(tmp_path / index["weight_map"][k])[k], t)


def test_recover_restores_a_folder_moved_aside_and_removes_a_half_written_one(tmp_path):
    target = tmp_path / "model"
    previous_folder(target)
    before = snapshot(target)
    os.replace(target, tmp_path / f".model{atomic.OLD}abcd")  # killed between the two renames
    (tmp_path / f".model{atomic.TMP}ef01").mkdir()
    (tmp_path / f".model{atomic.TMP}ef01" / "half").write_bytes(b"x")
    assert sorted(atomic.recover_all(tmp_path)) == [f".model{atomic.OLD}abcd", f".model{atomic.TMP}ef01"]
    assert snapshot(target) == before
    assert debris(tmp_path) == []


def test_smollm2_cache_start_removes_a_killed_conversions_temporaries(tmp_path, monkeypatch):
    from qerl.model import smollm2

    monkeypatch.setenv("QERL_CACHE", str(tmp_path))
    out = tmp_path / "SmolLM2-135M-Instruct"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"cached")
    (out / "config.json").write_text("{}")
    (tmp_path / f".SmolLM2-135M-Instruct{atomic.TMP}1234").mkdir()
    assert smollm2.smollm2_path() == out
    assert debris(tmp_path) == [] and (out / "model.safetensors").read_bytes() == b"cached"


def test_recover_leaves_a_live_writers_temporaries_alone(tmp_path):
    """Two processes filling the same cache at once: neither deletes the other's work in progress."""
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        theirs = tmp_path / f".model{atomic.TMP}{live.pid}-abcd"
        theirs.mkdir()
        dead = tmp_path / f".model{atomic.TMP}999999999-abcd"  # no such process
        dead.mkdir()
        assert atomic.recover(tmp_path / "model") == [dead.name]
        assert theirs.exists() and not dead.exists()
    finally:
        live.kill()
        live.wait()
    assert atomic.recover(tmp_path / "model") == [theirs.name]
