"""The default-run benchmark's per-seed measurement: the child's peak RSS (issue 50 asks for it beside every
default-run row; the child's own, by wait4, at least its parent's size at the fork), its exit status, and the
CPU named in each row's note."""

import platform
import sys

import pytest

from qerl.bench import default_run
from qerl.bench.default_run import cpu_model, run_measured


def test_the_peak_rss_is_the_childs_own(tmp_path):
    big = "b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096]); print('ok')"
    rc, out, _, rss = run_measured([sys.executable, "-c", big], tmp_path / "a")
    # (a forked child starts with its parent's pages: the figure is at least the child's own 300 MiB)
    assert rc == 0 and out.strip() == "ok" and rss >= 0.29
    rc, _, _, _ = run_measured([sys.executable, "-c", "import sys; sys.exit(3)"], tmp_path / "b")
    assert rc == 3


# two logical CPUs of an x86 /proc/cpuinfo, abridged: the name after "model name", not "cpu family" or "model"
X86 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC 7B13 64-Core Processor
stepping\t: 0

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC 7B13 64-Core Processor
"""
# an arm64 kernel's: no model name
ARM = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics
CPU implementer\t: 0x41
CPU part\t: 0xd0c
"""


@pytest.fixture
def cpuinfo(tmp_path, monkeypatch):
    def write(text):
        p = tmp_path / "cpuinfo"
        p.write_text(text)
        monkeypatch.setattr(default_run, "CPUINFO", p)
    monkeypatch.setattr(platform, "processor", lambda: "")
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    return write


def test_the_cpu_is_named_by_cpuinfos_model_name(cpuinfo):
    cpuinfo(X86)
    assert cpu_model() == "AMD EPYC 7B13 64-Core Processor"
    cpuinfo("model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz  \nmodel name\t: other\n")
    assert cpu_model() == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"  # the first, its padding stripped


def test_without_a_model_name_the_platform_names_the_cpu(cpuinfo, tmp_path, monkeypatch):
    cpuinfo(ARM)
    assert cpu_model() == "aarch64"  # platform.processor() is empty on Linux: the machine
    monkeypatch.setattr(platform, "processor", lambda: "arm")
    assert cpu_model() == "arm"
    monkeypatch.setattr(default_run, "CPUINFO", tmp_path / "absent")  # no /proc (macOS): no error, the platform
    assert cpu_model() == "arm"
