"""The default-run benchmark's per-seed measurement: the child's own peak RSS (issue 50 asks for it beside
every default-run row) and its exit status."""

import sys

from qerl.bench.default_run import cpu_model, run_measured


def test_the_peak_rss_is_the_childs_own(tmp_path):
    big = "b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096]); print('ok')"
    rc, out, _, rss = run_measured([sys.executable, "-c", big], tmp_path / "a")
    assert rc == 0 and out.strip() == "ok"
    # a later, smaller child reports its own peak, not the earlier one's (RUSAGE_CHILDREN would); a child's
    # figure may include the parent's pages it was forked with, so the 300 MiB shows as the difference
    rc, _, err, small = run_measured([sys.executable, "-c", "import sys; sys.exit(3)"], tmp_path / "b")
    assert rc == 3 and 0.25 <= rss - small <= 0.45


def test_the_cpu_is_named():
    assert cpu_model().strip()
