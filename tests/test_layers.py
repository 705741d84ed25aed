"""The layer rules of pyproject.toml [tool.importlinter] (docs/design.md "Layers") hold on this tree,
break on one deliberate violation, and no module of ours is part of an import cycle."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

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


def test_the_analysis_importing_the_engine_or_mlflow_outside_its_home_breaks_them(tmp_path):
    """The analysis importing the sweep engine breaks the one direction (launchers -> analysis); tracking's
    runs.py importing MLflow breaks its one home (tracking/store.py)."""
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    for path, line in (("analysis/stats.py", "from launchers.plan import cells"),
                       ("fp8rl_core/tracking/runs.py", "import mlflow")):
        module = tmp_path / path
        module.write_text(module.read_text() + f"\n{line}  # noqa: E402  (deliberate)\n")
    out = _lint(tmp_path)
    assert out.returncode == 1, out.stdout
    assert "analysis.stats -> launchers.plan.cells" in out.stdout
    assert "fp8rl_core.tracking.runs -> mlflow" in out.stdout
    text = " ".join(out.stdout.split())  # contract names wrap across lines
    assert "the sweep engine calls the analysis, never the other way round BROKEN" in text, out.stdout
    assert "each behind one home (lazily imported) BROKEN" in text, out.stdout


_NO_MLFLOW = """
import sys
import analysis, analysis.report, fp8rl_core.tracking.lifecycle, fp8rl_core.tracking.runs, launchers.cli
import launchers.run.driver
print(sorted(m for m in sys.modules if m == "mlflow" or m.startswith("mlflow.")))
"""


def test_the_sweep_command_and_the_analysis_load_without_mlflow():
    """MLflow is imported lazily at its one home (tracking/store.py), on the first client: the `sweep`
    command, the analysis and tracking's run management import cheaply (a fresh interpreter)."""
    out = subprocess.run([sys.executable, "-c", _NO_MLFLOW], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=300, check=True)
    assert json.loads(out.stdout.strip().replace("'", '"')) == []


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative) of `edges`
    (module -> the modules it imports directly)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
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


_EDGES = """
import json, grimp
packages = ("fp8rl_core", "launchers", "analysis")
graph = grimp.build_graph(*packages, exclude_type_checking_imports=True, cache_dir=None)
modules = {m for m in graph.modules if m.split(".")[0] in packages and not graph.find_children(m)}
print(json.dumps({m: sorted(graph.find_modules_directly_imported_by(m) & modules) for m in modules}))
"""


def _our_edges() -> dict[str, set[str]]:
    """Direct imports between our modules, lazy ones included; packages' __init__ modules are left out
    (re-exporting their own modules is not a cycle of ideas). Built in a subprocess rooted at the
    repository, as lint-imports runs: under pytest, tests/analysis etc. would shadow the packages."""
    out = subprocess.run([sys.executable, "-c", _EDGES], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=300, check=True)
    return {m: set(v) for m, v in json.loads(out.stdout).items()}


def test_no_module_is_in_an_import_cycle():
    """Lazy (function-level) imports count: a cycle through one is still two modules that need each other."""
    edges = _our_edges()
    assert len(edges) > 100 and sum(map(len, edges.values())) > 300  # the real graph, not an empty one
    assert _cycles(edges) == []


def test_the_cycle_finder_finds_one():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e2"}, "e2": {"e"}}
    assert _cycles(edges) == [["a", "b", "c"], ["e", "e2"]]
