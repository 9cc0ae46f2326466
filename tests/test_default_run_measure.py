"""The default-run benchmark's per-seed measurement: the child's peak RSS (issue 50 asks for it beside every
default-run row; the child's own, by wait4, at least its parent's size at the fork) and its exit status."""

import sys

from qerl.bench.default_run import cpu_model, run_measured


def test_the_peak_rss_is_the_childs_own(tmp_path):
    big = "b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096]); print('ok')"
    rc, out, _, rss = run_measured([sys.executable, "-c", big], tmp_path / "a")
    # (a forked child starts with its parent's pages: the figure is at least the child's own 300 MiB)
    assert rc == 0 and out.strip() == "ok" and rss >= 0.29
    rc, _, _, _ = run_measured([sys.executable, "-c", "import sys; sys.exit(3)"], tmp_path / "b")
    assert rc == 3


def test_the_cpu_is_named():
    assert cpu_model().strip()
