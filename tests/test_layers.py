"""The layer rules of pyproject.toml [tool.importlinter] (docs/design.md "Layers") hold on this tree,
break on one deliberate violation, hold for the imports lint-imports leaves out (those under
`if TYPE_CHECKING:`), and no module of ours is part of an import cycle."""
from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
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


# --- imports under `if TYPE_CHECKING:` -------------------------------------------------------------
# lint-imports runs with exclude_type_checking_imports = true, so a type-only import that climbs a layer
# (fp8/ naming a config type, say) passes it; this check reads the sources themselves.
OUTSIDE_THE_CORE = ("launchers", "analysis")


def core_layers(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, int]:
    """fp8rl_core's top-level modules and packages -> their layer's rank (0: the top), from the layers contract."""
    import tomllib  # Python 3.11+ (as tests/launchers/test_private_apis.py reads it)
    contracts = tomllib.loads(pyproject.read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c["layers"] for c in contracts if c["type"] == "layers" and c["containers"] == ["fp8rl_core"])
    return {name.strip(): rank for rank, layer in enumerate(layers) for name in layer.split("|")}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported(stmt: ast.stmt, package: list[str]) -> Iterator[str]:
    """The dotted names an import statement reaches (`from a import b` reaches a.b: b may be a module)."""
    if isinstance(stmt, ast.Import):
        yield from (alias.name for alias in stmt.names)
    elif isinstance(stmt, ast.ImportFrom):
        base = package[:len(package) - stmt.level + 1] if stmt.level else []
        module = ".".join([*base, *([stmt.module] if stmt.module else [])])
        yield from (f"{module}.{alias.name}" for alias in stmt.names)


def type_checking_violations(source: str, module: str, ranks: dict[str, int], is_package: bool = False) -> list[str]:
    """`module -> target` for each import under an `if TYPE_CHECKING:` of `source` (the text of fp8rl_core
    module `module`) that the layers contract forbids: a target in a layer above the module's own or in an
    independent sibling (`a | b`), or outside the core (launchers, analysis)."""
    parts = module.split(".")
    own = parts[1] if len(parts) > 1 else None
    if own not in ranks:
        return []
    package = parts if is_package else parts[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.If) and _is_type_checking(node.test)):
            continue
        for stmt in (s for b in node.body for s in ast.walk(b)):
            for target in _imported(stmt, package):
                top = target.split(".")
                climbs = top[0] == "fp8rl_core" and len(top) > 1 and top[1] in ranks and top[1] != own \
                    and ranks[top[1]] <= ranks[own]
                if climbs or top[0] in OUTSIDE_THE_CORE:
                    found.append(f"{module} -> {target}")
    return found


def _core_sources() -> Iterator[tuple[str, str, bool]]:
    for path in sorted((ROOT / "fp8rl_core").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        is_package = rel.name == "__init__"
        yield ".".join(rel.parts[:-1] if is_package else rel.parts), path.read_text(), is_package


def test_no_type_checking_import_climbs_a_layer():
    """fp8/ and model/ above all: they take the recipe's values and the fp8 `Quantization`, never a config type."""
    ranks = core_layers()
    sources = list(_core_sources())
    assert sum(m.startswith(("fp8rl_core.fp8.", "fp8rl_core.model.")) for m, _, _ in sources) > 20
    found = [v for module, text, is_package in sources for v in type_checking_violations(text, module, ranks,
                                                                                         is_package)]
    assert found == [], "type-only imports that climb a layer (import the type from its own layer, or " \
                        f"describe what you read with a Protocol): {found}"


PLANTED = """
from __future__ import annotations
import typing
from typing import TYPE_CHECKING

from fp8rl_core.config.recipe import Recipe as Allowed  # not type-only: lint-imports' business, not this check's
from fp8rl_core.fp8.quantization import Quantization

if TYPE_CHECKING:
    from fp8rl_core.fp8.linear import Fp8Linear  # below model/: fine
    from fp8rl_core.config.recipe import Recipe
    from fp8rl_core import loop
    from ..config import run_config
else:
    from fp8rl_core.engines import native_train  # runtime, not type-only
if typing.TYPE_CHECKING:
    import launchers.plan
    from fp8rl_core.model.llama import CausalLM  # its own layer
"""


def test_a_planted_type_checking_import_is_caught():
    ranks = core_layers()
    assert type_checking_violations(PLANTED, "fp8rl_core.model.fp8_policy", ranks) == [
        "fp8rl_core.model.fp8_policy -> fp8rl_core.config.recipe.Recipe",
        "fp8rl_core.model.fp8_policy -> fp8rl_core.loop",
        "fp8rl_core.model.fp8_policy -> fp8rl_core.config.run_config",
        "fp8rl_core.model.fp8_policy -> launchers.plan",
    ]
    # what fp8/linear.py held before Quantization moved beside the kernels
    old = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fp8rl_core.config.recipe import Quantization\n"
    assert type_checking_violations(old, "fp8rl_core.fp8.linear", ranks) == [
        "fp8rl_core.fp8.linear -> fp8rl_core.config.recipe.Quantization"]
    sibling = "if TYPE_CHECKING:\n    from fp8rl_core.tasks import arithmetic\n"  # algorithms | tasks: independent
    assert type_checking_violations(sibling, "fp8rl_core.algorithms.grpo", ranks) == [
        "fp8rl_core.algorithms.grpo -> fp8rl_core.tasks.arithmetic"]
    assert type_checking_violations(sibling, "fp8rl_core.loop.step", ranks) == []  # loop is above tasks


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


def _grep(pattern: str, *folders: str) -> list[str]:
    """The lines of our Python sources under `folders` (relative to the repository) that match `pattern`."""
    rx = re.compile(pattern)
    return [f"{p.relative_to(ROOT)}:{i}" for folder in folders for p in sorted((ROOT / folder).rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if rx.search(line)]


def test_the_seams_stay_typed():
    """Issue 33's seams, kept: no side channel on the run context or the engines (results are returned), one
    recipe resolution in the builder, and the BF16 knob read in at most six core files (below the run setup
    only the plain `upcast_bf16` flag flows)."""
    core = ("fp8rl_core/loop", "fp8rl_core/diagnostics", "fp8rl_core/engines")
    assert _grep(r"hasattr\(ctx|setattr\(ctx|__dict__\.pop", *core) == []
    in_builder = [x for x in _grep(r"recipe_of\(", "fp8rl_core/loop") if x.startswith("fp8rl_core/loop/builder.py:")]
    assert len(in_builder) == 1, in_builder
    files = {x.split(":")[0] for x in _grep(r"bf16_compute|emulate_bf16", "fp8rl_core")}
    assert len(files) <= 6, sorted(files)
