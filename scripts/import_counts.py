"""The import counts of issue 48's targets, read from src/qerl's syntax trees (no import is executed).

    python scripts/import_counts.py [--list]

  sft_from_rl       import statements in sft/ that name a module of rl/
  back_edges        imports from a package to one above it in LAYERS (importing module, imported package)
  private_imports   `from <another module> import _name` sites (a single leading underscore)
  function_imports  import statements inside a function body (any depth)
  load_py_lines     lines of model/load.py
  over_600          modules over 600 lines outside bench/
--list prints each site.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src" / "qerl"
# low to high: a package may import those before it. Top-level modules (device_memory, invocation) sit at
# the bottom; the CLI, the recipes (which call it) and the entry point (__main__) at the top. Any order
# leaves one back-edge per import cycle between two packages (model<->checkpoint, tasks<->tools, ...).
LAYERS = ["<top>", "formats", "kernels", "layers", "checkpoint", "model", "rollout", "tools", "tasks", "train",
          "rl", "sft", "trl", "study", "bench", "cli", "recipes", "<main>"]


@dataclass
class Counts:
    sft_from_rl: list = field(default_factory=list)
    back_edges: list = field(default_factory=list)
    private_imports: list = field(default_factory=list)
    function_imports: list = field(default_factory=list)


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names."""
    if node.level == 0:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _package(mod: str) -> str | None:
    parts = mod.split(".")
    if parts[0] != "qerl":
        return None
    if len(parts) > 1 and parts[1] == "__main__":
        return "<main>"
    if len(parts) == 1 or (ROOT / f"{parts[1]}.py").exists():
        return "<top>"
    return parts[1]


def _targets(mod: str, is_pkg: bool, node) -> list[tuple[str, str | None]]:
    """(imported module, imported name or None) of an import statement."""
    if isinstance(node, ast.Import):
        return [(a.name, None) for a in node.names]
    src = _resolve(mod, is_pkg, node)
    out = []
    for a in node.names:
        sub = f"{src}.{a.name}"
        sub_path = ROOT.parent / sub.replace(".", "/")
        is_module = sub_path.with_suffix(".py").exists() or (sub_path / "__init__.py").exists()
        out.append((sub, None) if is_module else (src, a.name))
    return out


def count() -> Counts:
    c = Counts()
    for path in sorted(ROOT.rglob("*.py")):
        mod, is_pkg = _module(path), path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        where = str(path.relative_to(ROOT))
        funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        in_func = {id(i) for f in funcs for i in ast.walk(f) if isinstance(i, (ast.Import, ast.ImportFrom))}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            site = f"{where}:{node.lineno}"
            if id(node) in in_func:
                c.function_imports.append(site)
            mine = _package(mod)
            for target, name in _targets(mod, is_pkg, node):
                theirs = _package(target)
                if theirs is None:
                    continue
                if mine == "sft" and theirs == "rl":
                    c.sft_from_rl.append(f"{site} {target}")
                edge = f"{site} {mod} -> {target}"
                if LAYERS.index(theirs) > LAYERS.index(mine) and edge not in c.back_edges:
                    c.back_edges.append(edge)
                if name and name.startswith("_") and not name.startswith("__") and target != mod:
                    c.private_imports.append(f"{site} {target}.{name}")
    return c


def main(argv: list[str]) -> None:
    c = count()
    load_lines = len((ROOT / "model" / "load.py").read_text().splitlines())
    big = sorted((len(p.read_text().splitlines()), str(p.relative_to(ROOT))) for p in ROOT.rglob("*.py")
                 if "bench" not in p.relative_to(ROOT).parts and len(p.read_text().splitlines()) > 600)
    edges = sorted({(s.split()[1].split(".")[1], s.split()[3].split(".")[1]) for s in c.back_edges})
    print(f"sft_from_rl {len(c.sft_from_rl)}")
    print(f"back_edges {len(c.back_edges)} import sites, {len(edges)} package pairs: "
          + ", ".join(f"{a}->{b}" for a, b in edges))
    print(f"private_imports {len(c.private_imports)}")
    print(f"function_imports {len(c.function_imports)}")
    print(f"load_py_lines {load_lines}")
    print(f"over_600 {len(big)}: " + ", ".join(f"{p} ({n})" for n, p in big))
    if "--list" in argv:
        for k in ("sft_from_rl", "back_edges", "private_imports"):
            print(f"\n{k}:")
            for s in getattr(c, k):
                print("  " + s)


if __name__ == "__main__":
    main(sys.argv[1:])
