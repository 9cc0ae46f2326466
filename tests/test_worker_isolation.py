"""Issue 40, security: reward and tool workers never import from the folder a run starts in.
They started as `python -m qerl.tasks.deadline`, which puts the current folder first on the import
path: a `math_verify.py` there was executed by every reward worker."""

from __future__ import annotations

import os
import sys

import pytest

from qerl.deadline import DeadlinePool

EVIL = "import pathlib\npathlib.Path({marker!r}).write_text('executed')\n{body}"


def _plant(folder, marker, name="math_verify", body="raise SystemExit(3)\n"):
    (folder / f"{name}.py").write_text(EVIL.format(marker=str(marker), body=body))


@pytest.mark.parametrize("on_path", [False, True], ids=["qerl-script", "python-script-in-that-folder"])
def test_a_math_verify_py_in_the_current_folder_is_never_imported(tmp_path, monkeypatch, on_path):
    pytest.importorskip("math_verify")
    import math_verify  # noqa: F401 - this process's own import, before the folder is on the path

    work, marker = tmp_path / "work", tmp_path / "marker"
    work.mkdir()
    _plant(work, marker)
    monkeypatch.chdir(work)
    if on_path:  # `python train.py` in that folder: the folder is also on this process's path
        monkeypatch.syspath_prepend(str(work))
    pool = DeadlinePool(workers=1, warm=("math_verify",))
    try:
        out = pool.map("qerl.tasks.rewards:_math_verify_one", [("<answer>\\frac{1}{2}</answer>", "0.5", 5)], 60)
    finally:
        pool.close()
    assert not marker.exists(), "the worker executed the current folder's math_verify.py"
    assert out == [(True, 1.0)]


def test_the_symbolic_reward_through_its_shared_pool_ignores_the_current_folder(tmp_path, monkeypatch):
    pytest.importorskip("math_verify")
    from qerl import deadline
    from qerl.tasks.rewards import numeric_accuracy

    work, marker = tmp_path / "work", tmp_path / "marker"
    work.mkdir()
    _plant(work, marker)
    _plant(work, marker, name="sympy")
    monkeypatch.chdir(work)
    monkeypatch.setattr(deadline, "_SHARED", {})  # fresh workers, started from this folder
    try:
        assert numeric_accuracy(["#### 2^{3}"], ["8"]) == [1.0]
    finally:
        for pool in deadline._SHARED.values():
            pool.close()
    assert not marker.exists()


def test_a_tool_module_beside_the_users_script_still_runs_in_a_worker(tmp_path, monkeypatch):
    """The user's own tool module, imported by this process from its folder, is what the worker
    imports too (its folder comes last, after the installed packages), not a planted math_verify."""
    from qerl.tools.calls import ToolCall
    from qerl.tools.runner import ToolRunner

    work, marker = tmp_path / "work", tmp_path / "marker"
    work.mkdir()
    (work / "my_tools_r4.py").write_text("def double(x: int) -> int:\n    '''Twice x.\n\n    Args:\n        x: a number\n    '''\n    return 2 * x\n")
    _plant(work, marker)
    monkeypatch.chdir(work)
    monkeypatch.syspath_prepend(str(work))
    import my_tools_r4

    from qerl import deadline

    monkeypatch.setattr(deadline, "_SHARED", {})
    try:
        runner = ToolRunner([my_tools_r4.double])
        assert runner.targets["double"] == "my_tools_r4:double"  # it runs in a worker process
        assert runner.run(ToolCall(name="double", arguments={"x": 21})) == "42"
        pool = deadline.shared_pool(runner.warm)
        job = ("<answer>\\frac{1}{2}</answer>", "0.5", 5)  # the installed math_verify, not the planted one
        assert pool.map("qerl.tasks.rewards:_math_verify_one", [job], 60) == [(True, 1.0)]
    finally:
        for pool in deadline._SHARED.values():
            pool.close()
        sys.modules.pop("my_tools_r4", None)
    assert not marker.exists()


def test_the_worker_path_has_no_current_folder(tmp_path, monkeypatch):
    from qerl.deadline import worker_path

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend("")
    path = worker_path()
    assert "" not in path and all(os.path.realpath(p) != str(tmp_path.resolve()) for p in path)
