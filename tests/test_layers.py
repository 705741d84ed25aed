"""The layer rules of pyproject.toml [tool.importlinter] (docs/design.md "Layers") hold on this tree,
break on one deliberate violation, and no module of ours is part of an import cycle."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fp8rl_core", "launchers", "analysis")


def _lint(root: Path) -> subprocess.CompletedProcess:
    """lint-imports on the packages under `root` (PYTHONPATH puts them before the installed ones)."""
    exe = Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(exe), "--no-cache", "--config", str(root / "pyproject.toml")], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_layer_contracts_hold():
    out = _lint(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_deliberate_violation_breaks_them(tmp_path):
    """fp8/ importing the sweep engine must break two contracts (core -> launchers, and the layers)."""
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    quant = tmp_path / "fp8rl_core" / "fp8" / "quant.py"
    quant.write_text(quant.read_text() + "\nfrom launchers.run import session  # noqa: E402  (deliberate)\n")
    out = _lint(tmp_path)
    assert out.returncode == 1, out.stdout
    assert "fp8rl_core.fp8.quant -> launchers.run.session" in out.stdout
    assert "BROKEN" in out.stdout and "core imports neither" in out.stdout


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    mods = sorted(m for m in graph.modules if m.split(".")[0] in PACKAGES)
    for root in mods:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next((c for c in children if c.split(".")[0] in PACKAGES), None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_module_is_in_an_import_cycle():
    """Lazy (function-level) imports count: a cycle through one is still two modules that need each other.
    A package's __init__ re-exporting its own modules is not a cycle of ideas, so __init__ modules are left out."""
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True, cache_dir=None)
    for m in [m for m in graph.modules if m in PACKAGES or graph.find_children(m)]:
        graph.remove_module(m)  # packages' __init__: re-exports only
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_one():
    graph = grimp.ImportGraph()
    for a, b in (("fp8rl_core.a", "fp8rl_core.b"), ("fp8rl_core.b", "fp8rl_core.c"), ("fp8rl_core.c", "fp8rl_core.a"),
                 ("fp8rl_core.c", "fp8rl_core.d")):
        graph.add_import(importer=a, imported=b)
    assert _cycles(graph) == [["fp8rl_core.a", "fp8rl_core.b", "fp8rl_core.c"]]
