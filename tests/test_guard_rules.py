"""Issue 60 follow-ups: the rules each writer and guard shares, checked where a user meets them.

1. SIGTERM during any command's write (not only `qerl export`'s): its temporary removed, one line, status 143;
2. a NaN/inf weight quantized from memory (random init, the 4-bit lm_head, a loader's group) is a
   NonFiniteWeightError, never first a "leaving this layer in bf16" warning;
3. a run started from Python never clears a folder holding its own model or adapter (as `qerl train` does not);
4. a long output name (250 bytes) is written, and a killed save of it recovered; a symlinked output is
   written through (the link stays, its target gets the new content);
5. `qerl export` / `qerl quantize` refuse an output that is, holds or lies inside what they read: the one rule
   of checkpoint/guard.py own_input, which train's run folders use too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from cli_runs import one_line

from qerl.checkpoint import atomic

SRC = str(Path(__file__).resolve().parents[1] / "src")
ENV = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _debris(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if atomic.TMP in p.name or atomic.OLD in p.name)


@pytest.fixture(scope="module")
def adapter(model, tmp_path_factory):
    """A LoRA adapter of the tiny model (random B), in a folder of its own."""
    from qerl.checkpoint import save_adapter
    from qerl.model import load_policy

    pol = load_policy(str(model), "nvfp4", lora_rank=4, dtype=torch.float32, progress=False)
    with torch.no_grad():
        for m in pol.model.modules():
            if hasattr(m, "lora_B") and getattr(m, "r", 0):
                m.lora_B.weight.normal_(0, 0.05)
    return save_adapter(pol, tmp_path_factory.mktemp("a") / "adapter")


# ---- 1. SIGTERM inside a write of any command ---------------------------------------------------------------
SIGTERM_AT_WRITE = """
import os, signal, sys
from qerl.checkpoint import atomic
def hook(stage):
    if stage == "writing":
        os.kill(os.getpid(), signal.SIGTERM)
atomic.fault_hook = hook
from qerl.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_while_quantize_writes_cleans_up_and_says_so(model, tmp_path):
    """Before: status 143 and its temporary removed, but not a word (only `qerl export` said it)."""
    out = tmp_path / "q"
    p = subprocess.run([sys.executable, "-c", SIGTERM_AT_WRITE, "quantize", str(model), str(out)],
                       capture_output=True, text=True, env=ENV, timeout=300)
    assert p.returncode == 143, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1] == ("qerl quantize: stopped by SIGTERM; nothing written (the output "
                                                 "folder is unchanged)"), p.stderr[-2000:]
    assert _debris(tmp_path) == [] and not out.exists()


def test_another_system_exit_is_not_taken_for_a_sigterm(monkeypatch, capsys):
    """sys.exit(3) inside a command stays sys.exit(3): only atomic.Terminated is a signal."""
    from qerl import cli

    monkeypatch.setattr(cli.inspect, "run", lambda args: sys.exit(3))
    with pytest.raises(SystemExit) as e:
        cli.main(["inspect", "x"])
    assert e.value.code == 3 and "stopped by" not in capsys.readouterr().err


# ---- 2. NaN/inf in a weight quantized from memory ----------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4"])
def test_validate_calls_a_nan_weight_corrupt_not_unquantizable(fmt):
    from qerl.formats import QuantizationError, get_format
    from qerl.formats.base import NonFiniteWeightError

    w = torch.randn(4, 128)
    w[1, 2] = float("inf")
    with pytest.raises(NonFiniteWeightError, match=r"layers\.3\.q_proj holds NaN or inf \(first at index \[1, 2\]") as e:
        get_format(fmt).validate(w, "layers.3.q_proj")
    assert not isinstance(e.value, QuantizationError)  # no loader's `except QuantizationError` falls back on it
    w = torch.randn(4, 100)  # NaN and a shape the format cannot tile: the NaN is what is wrong
    w[0, 0] = float("nan")
    with pytest.raises(NonFiniteWeightError):
        get_format(fmt).validate(w, "layers.3.q_proj")


class _Weights:
    """A loader's checkpoint reader over tensors in memory (get, `in`), as quantize_group reads one."""

    def __init__(self, tensors):
        self.tensors = tensors

    def get(self, name, device=None):
        return self.tensors[name]

    def __contains__(self, name):
        return name in self.tensors


def test_a_nan_weight_in_a_quantized_group_stops_with_no_bf16_warning_first():
    """Before: "...NaN/inf value(s); refusing to quantize; leaving this layer in bf16" warned, and the layer
    went on in bf16, NaN and all."""
    from qerl.formats import get_format
    from qerl.formats.base import NonFiniteWeightError
    from qerl.model.projections import quantize_group

    names = ["layers.0.q_proj", "layers.0.k_proj"]
    ws = {f"{n}.weight": torch.randn(32, 64) for n in names}
    ws["layers.0.k_proj.weight"][5, 6] = float("nan")
    fallback = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        with pytest.raises(NonFiniteWeightError, match=r"layers\.0\.k_proj holds NaN or inf \(first at index \[5, 6\]"):
            quantize_group(_Weights(ws), names, get_format("nvfp4"), {"lora_rank": 0}, "cpu", fallback, False)
    assert fallback == []


def test_a_nan_lm_head_is_refused_by_name():
    from qerl.formats.base import NonFiniteWeightError
    from qerl.layers.quant_head import QuantHead

    head = torch.nn.Linear(64, 32, bias=False)
    with torch.no_grad():
        head.weight[3, 4] = float("nan")
    with pytest.raises(NonFiniteWeightError, match=r"lm_head\.weight holds NaN or inf \(first at index \[3, 4\]"):
        QuantHead.from_linear(head)


# ---- 3. a run from Python guards its inputs --------------------------------------------------------------------
def test_a_python_run_into_the_folder_holding_its_adapter_is_refused_by_name(tmp_path):
    """Before: the trainer cleared the folder (`overwrite_output_dir`) and with it the adapter it trains from."""
    from tiny_models import config, tiny_tokenizer

    from qerl.checkpoint import save_adapter
    from qerl.model import random_policy
    from qerl.rl import GRPOConfig, GRPOTrainer
    from qerl.tasks import get_task
    from qerl.train.run_folder import RunFolderError

    pol = random_policy(config("qwen2"), "nvfp4", lora_rank=4, device="cpu", dtype=torch.float32, std=0.05,
                        progress=False)
    pol.tokenizer = tiny_tokenizer()
    run = tmp_path / "R"
    save_adapter(pol, run / "adapter")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')  # an earlier run, whose adapter the new run starts from
    before = _snapshot(run)
    cfg = GRPOConfig(model_name_or_path=str(run / "adapter"), output_dir=str(run), overwrite_output_dir=True,
                     max_steps=1, generation_batch_size=4, num_generations=2, per_device_train_batch_size=4,
                     max_completion_length=4, max_prompt_length=48, save_steps=1, report_to="none")
    trainer = GRPOTrainer(cfg, policy=pol, task=get_task("arithmetic", size=8),
                          reward_funcs=[lambda completions, **_: [0.0] * len(completions)], progress=False)
    with pytest.raises(RunFolderError) as e:
        trainer.train()
    assert f"{run}: holds the run's own adapter (model_name_or_path) {run / 'adapter'}" in str(e.value)
    assert _snapshot(run) == before


# ---- 4. long names and symlinked outputs -----------------------------------------------------------------------
def _name_max(folder) -> int:
    return os.pathconf(folder, "PC_NAME_MAX")


def test_a_folder_of_a_250_byte_name_is_written_with_every_temporary_within_name_max(tmp_path, monkeypatch):
    """Before: OSError File name too long, on the temporary's name (the target's name was fine)."""
    out = tmp_path / ("m" * 250)
    seen = []
    monkeypatch.setattr(atomic, "fault_hook", lambda stage: seen.extend(p.name for p in tmp_path.iterdir()))
    for content in ("old", "new"):  # the second swap moves the first aside: both temporaries' names
        with atomic.atomic_folder(out) as tmp:
            (tmp / "a.txt").write_text(content)
    assert (out / "a.txt").read_text() == "new" and _debris(tmp_path) == []
    temps = {n for n in seen if atomic.TMP in n or atomic.OLD in n}
    assert any(atomic.OLD in n for n in temps) and any(atomic.TMP in n for n in temps)
    assert all(len(n.encode()) <= _name_max(tmp_path) for n in temps)
    f = tmp_path / ("é" * 125)  # 250 bytes, 125 characters: cut between characters, never inside one
    atomic.atomic_text(f, "x")
    assert f.read_text() == "x" and _debris(tmp_path) == []


KILL_AT = """
import os, signal, sys
from pathlib import Path
from qerl.checkpoint import atomic
def hook(stage):
    if stage == sys.argv[2]:
        os.kill(os.getpid(), signal.SIGKILL)
atomic.fault_hook = hook
with atomic.atomic_folder(sys.argv[1]) as tmp:
    (tmp / "a.txt").write_text("new")
"""


@pytest.mark.parametrize("stage", ["written", "aside"])
def test_a_killed_save_of_a_long_name_is_recovered(tmp_path, stage):
    """A run folder's start (recover_all) and the next save (recover) find the shortened temporaries."""
    out = tmp_path / ("c" * 250)
    out.mkdir()
    (out / "a.txt").write_text("old")
    p = subprocess.run([sys.executable, "-c", KILL_AT, str(out), stage], env=ENV, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    assert _debris(tmp_path)  # the killed save left its temporaries
    atomic.recover_all(tmp_path)
    if stage == "aside":  # killed between the two renames: the target's full name is not in the temporary's
        assert not out.exists() and [n for n in _debris(tmp_path) if atomic.OLD in n]  # kept, never deleted
        atomic.recover(out)  # what every save of `out` runs first
    assert (out / "a.txt").read_text() == "old" and _debris(tmp_path) == []


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_a_symlinked_target_is_written_through(tmp_path, kind):
    """Before: the link itself was replaced by a folder (or file), its target left with the old content."""
    real = tmp_path / "real"
    link = tmp_path / "link"
    if kind == "folder":
        real.mkdir()
        (real / "a.txt").write_text("old")
        link.symlink_to(real, target_is_directory=True)
        with atomic.atomic_folder(link) as tmp:
            (tmp / "a.txt").write_text("new")
        assert (real / "a.txt").read_text() == "new"
    else:
        real.write_text("old")
        link.symlink_to(real)
        assert atomic.atomic_text(link, "new") == link
        assert real.read_text() == "new"
    assert link.is_symlink() and Path(os.readlink(link)) == real
    assert _debris(tmp_path) == []


def test_quantize_into_a_long_name_and_into_a_linked_folder(cli, model, tmp_path):
    long_out = tmp_path / ("q" * 250)
    rc, _, err = cli("quantize", model, long_out)
    assert rc == 0, err
    assert json.loads((long_out / "config.json").read_text())["quantization_config"]
    real, link = tmp_path / "real", tmp_path / "link"
    real.mkdir()
    link.symlink_to(real, target_is_directory=True)
    rc, _, err = cli("quantize", model, link)
    assert rc == 0, err
    assert link.is_symlink() and (real / "config.json").is_file() and _debris(tmp_path) == []


# ---- 5. export's and quantize's guard: the one rule of run folders ---------------------------------------------
def test_export_into_a_folder_inside_its_own_adapter_is_refused(cli, model, adapter, no_model_load):
    """Before: accepted, a merged model written into the adapter folder (which `--overwrite` would then clear)."""
    before = _snapshot(adapter)
    rc, _, err = cli("export", model, adapter / "merged", "--adapter", adapter)
    assert rc == 2 and one_line(err), err
    assert f"{adapter / 'merged'}: is inside the adapter ({adapter})" in err and "choose another output folder" in err
    assert _snapshot(adapter) == before and not (adapter / "merged").exists()


def test_quantize_into_a_folder_inside_its_model_is_refused(cli, model, no_model_load):
    rc, _, err = cli("quantize", model, model / "q")
    assert rc == 2 and one_line(err) and f"{model / 'q'}: is inside the model ({model})" in err, err


def test_train_and_export_answer_by_the_same_rule(tmp_path):
    """One rule (guard.own_input) behind both guards: the same three relations, links followed."""
    from qerl.checkpoint.guard import OutputFolderError, check_output_folder, own_input
    from qerl.train.run_folder import RunFolderError, RunInput, check_inputs

    src = tmp_path / "src"
    (src / "inner").mkdir(parents=True)
    (tmp_path / "link").symlink_to(src, target_is_directory=True)
    for out, how in [(tmp_path / "link", "is"), (tmp_path, "holds"), (src / "inner", "is inside")]:
        assert own_input(out, {"model": src})[0] == how
        with pytest.raises(RunFolderError, match=f": {how} the run's own model"):
            check_inputs(out, [RunInput("model", str(src))])
        with pytest.raises(OutputFolderError, match=f": {how} the model"):
            check_output_folder(out, overwrite=True, protected={"model": src})
    assert own_input(tmp_path / "other", {"model": src, "gone": tmp_path / "missing", "none": None}) is None
