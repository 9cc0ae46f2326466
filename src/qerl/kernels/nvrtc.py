"""Compiling the CUDA C++ kernels (w4_*.cu) at run time, and checking them without a GPU.

One owner for the sources and their compiled functions: each kernel file is prepended with
`w4_common.cuh` and a block of `#define`s; NVRTC (`torch.cuda._compile_kernel`, torch >= 2.8)
compiles it on first use per (file, kernel, defines, device). Why NVRTC: no nvcc and no new
dependency on the user's machine, and launches go through cuLaunchKernel on the current stream,
so CUDA graphs capture them.

`ptxas_report` compiles the same text with nvcc where one is installed (CI's machines have it, no
GPU needed) and returns what ptxas says of each kernel: registers, spills, and its performance
advisories, among them the one that says a wgmma sequence was serialized (which would otherwise
be silent: the kernel stays correct, only slow).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..formats.nvfp4_mma import BITS, RECIPE, SCALE_BIAS

_DIR = Path(__file__).parent
_COMMON = "w4_common.cuh"
_FUNCS: dict = {}


_INCLUDE = re.compile(r'^#include "(\w+\.cuh)"$', re.M)


def _inline_includes(text: str) -> str:
    """`#include "x.cuh"` of a file beside the kernels, inlined: torch's NVRTC call passes no headers."""
    return _INCLUDE.sub(lambda m: (_DIR / m.group(1)).read_text(), text)


def decode_v2_source() -> str:
    """decode_word's BITS 2 body, generated from formats/nvfp4_mma.RECIPE: the masks and rotations exist
    once, in Python, where the CPU tests decode with them."""
    lines = []
    for i, terms in enumerate(RECIPE[2]):
        parts = [("v" if r == 0 else f"rotl(v, {r})") + f" & 0x{mask:08X}u" for r, mask in terms]
        expr = " | ".join(f"({p})" for p in parts) if len(parts) > 1 else parts[0]
        lines.append(f"  a{i} = bmul2({expr}, {'sl' if i % 2 == 0 else 'sh'});")
    return "\n".join(lines)


def source(file: str, defines: dict, generated: dict | None = None) -> str:
    """The text NVRTC compiles: the #defines, the shared helpers, then the kernel file (its local includes
    inlined), with each placeholder line in `generated` replaced by its code (e.g. an MMA whose operand
    list depends on a tile)."""
    base = {"SCALE_BIAS": SCALE_BIAS, "BITS": BITS}
    head = "".join(f"#define {n} {v}\n" for n, v in {**base, **defines}.items())
    body = _inline_includes((_DIR / file).read_text())
    for name, code in (generated or {}).items():
        if name not in body:
            raise KeyError(f"{file} has no placeholder {name}")
        body = body.replace(name, code)
    common = (_DIR / _COMMON).read_text().replace("DECODE_V2_BODY", decode_v2_source())
    return head + common + body


def arch(device: torch.device) -> str:
    """sm_90 compiles as sm_90a: wgmma and setmaxnreg exist only there (torch passes the string through)."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")


def kernel(file: str, name: str, defines: dict, device: torch.device, generated: dict | None = None):
    """The compiled function `name` of `file` for these defines on `device` (compiled once)."""
    key = (file, name, tuple(sorted(defines.items())), tuple(sorted((generated or {}).items())), device.index)
    fn = _FUNCS.get(key)
    if fn is None:
        with torch.cuda.device(device):
            fn = torch.cuda._compile_kernel(source(file, defines, generated), name, compute_capability=arch(device),
                                            nvcc_options=["-std=c++17", "--use_fast_math"])
        _FUNCS[key] = fn
    return fn


@dataclass
class PtxasReport:
    """What ptxas printed for one kernel."""

    registers: int
    spill_stores: int
    spill_loads: int
    shared_bytes: int
    advisories: list[str] = field(default_factory=list)  # "Potential Performance Loss: ..." lines


def nvcc_available() -> bool:
    return shutil.which("nvcc") is not None


def parameters(file: str, name: str) -> list[str]:
    """The parameter names of kernel `name` in `file`, in order (launchers check their argument lists
    against it: a missing or extra argument would shift every later one silently)."""
    body = (_DIR / file).read_text()
    m = re.search(rf"\b{name}\s*\(([^)]*)\)", body)
    if m is None:
        raise KeyError(f"{file} has no kernel {name}")
    return [re.findall(r"(\w+)\s*$", p.strip())[0] for p in m.group(1).split(",")]


def ptxas_report(file: str, defines: dict, arch: str = "sm_90a", generated: dict | None = None) -> dict[str, PtxasReport]:
    """Compile with nvcc (to a cubin, no GPU needed) and parse ptxas -v per kernel."""
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.cu"
        src.write_text(source(file, defines, generated))
        out = subprocess.run(["nvcc", "-std=c++17", "--use_fast_math", f"-arch={arch}", "-cubin", "-Xptxas", "-v",
                              "-o", str(Path(d) / "k.cubin"), str(src)], capture_output=True, text=True)
    text = out.stdout + out.stderr
    if out.returncode:
        raise RuntimeError(f"nvcc failed on {file} with {defines}:\n{text}")
    reports: dict[str, PtxasReport] = {}
    current = None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line) or re.search(r"Function properties for (\w+)", line)
        if m and m.group(1) not in reports:
            current = m.group(1)
            reports[current] = PtxasReport(0, 0, 0, 0)
        if current is None:
            continue
        r = reports[current]
        if "Performance Loss" in line or "serialized" in line:
            r.advisories.append(line.strip())
        if m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line):
            r.spill_stores, r.spill_loads = int(m.group(1)), int(m.group(2))
        if m := re.search(r"Used (\d+) registers", line):
            r.registers = int(m.group(1))
        if m := re.search(r"(\d+) bytes smem", line):
            r.shared_bytes = int(m.group(1))
    return reports
