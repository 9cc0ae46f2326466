"""Issue 40, the first hour: the memory levers read MemFree, not MemAvailable, so the same config chose
gradient checkpointing off, then on, as the page cache filled. The CPU's budget is MemAvailable now."""

from __future__ import annotations

from qerl.train.levers import available_ram, free_memory


def _meminfo(tmp_path, free_kb, available_kb):
    f = tmp_path / "meminfo"
    f.write_text(f"MemTotal:       16000000 kB\nMemFree:         {free_kb} kB\nMemAvailable:   {available_kb} kB\n"
                 "Buffers:           1000 kB\nCached:         9000000 kB\n")
    return str(f)


def test_the_budget_is_mem_available_whatever_the_page_cache_holds(tmp_path):
    # the same machine before and after reading 9 GB of files: MemFree drops, MemAvailable does not
    before = available_ram(_meminfo(tmp_path, 12_000_000, 12_500_000))
    after = available_ram(_meminfo(tmp_path, 3_000_000, 12_400_000))
    assert before == 12_500_000 * 1024 and after == 12_400_000 * 1024


def test_without_meminfo_it_falls_back_to_free_pages(tmp_path):
    import os

    got = available_ram(str(tmp_path / "none"))
    assert got > 0 and abs(got - os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")) < 2 ** 30


def test_the_cpu_budget_reads_this_machines_mem_available():
    from pathlib import Path

    text = Path("/proc/meminfo").read_text() if Path("/proc/meminfo").is_file() else ""
    if "MemAvailable" not in text:
        return
    want = int(next(x for x in text.splitlines() if x.startswith("MemAvailable")).split()[1]) * 1024
    assert abs(free_memory("cpu") - want) < 2 ** 30  # read moments apart: within a GiB
