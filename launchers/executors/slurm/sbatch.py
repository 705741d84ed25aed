"""The sbatch script a SLURM sweep submits, rendered by submitit's own code (no copy of its format).

`slurm_submission(sweep)` is the one mapping from the sweep file's `launcher.slurm` to submitit: the
SLURM executor does `SlurmExecutor(folder=s.folder, python=s.python)` then
`executor.update_parameters(**s.parameters)` and submits the cells as one array (one batch); for
that, submitit writes exactly `render_sbatch(s, n_cells)` (tests/launchers/test_cli_plan.py checks
it against a submission through submitit's mocked `sbatch`).
"""
from __future__ import annotations

import shlex
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launchers.sweepfile.schema import slurm_minutes

if TYPE_CHECKING:  # pragma: no cover
    from launchers.sweepfile.loading import Sweep

JOBS_SUBFOLDER = "jobs/%j"  # submitit folder: one folder per job (per array task: per cell)


@dataclass(frozen=True)
class SlurmSubmission:
    folder: Path  # submitit's folder, absolute, with %j (pickles, sbatch files, logs)
    python: str  # shell command that runs python on the nodes
    parameters: dict[str, Any] = field(default_factory=dict)  # SlurmExecutor.update_parameters(**parameters)
    max_num_timeout: int = 3  # SlurmExecutor(max_num_timeout=...): a constructor argument, not an sbatch key


def slurm_submission(sweep: Sweep) -> SlurmSubmission:
    """launcher.slurm -> submitit's SlurmExecutor parameters (names of `_make_sbatch_string`)."""
    from submitit.slurm.slurm import _convert_mem

    s = sweep.launcher.slurm
    params: dict[str, Any] = {
        "job_name": sweep.experiment,
        "time": slurm_minutes(s.time),
        "nodes": s.nodes,
        "ntasks_per_node": s.tasks_per_node,
        "array_parallelism": sweep.launcher.max_parallel,
        "signal_delay_s": s.signal_delay_s,
    }
    optional = {"partition": s.partition, "account": s.account, "qos": s.qos, "gpus_per_node": s.gpus_per_node,
                "cpus_per_task": s.cpus_per_task, "mem": None if s.mem_gb is None else _convert_mem(s.mem_gb),
                "setup": list(s.setup) or None, "additional_parameters": dict(s.additional_parameters) or None}
    params.update({k: v for k, v in optional.items() if v is not None})
    python = s.python if s.python else shlex.quote(sys.executable)  # submitit's own default
    return SlurmSubmission(sweep.folder / JOBS_SUBFOLDER, python, params, s.max_num_timeout)


def render_sbatch(sub: SlurmSubmission, n_tasks: int) -> str:
    """The sbatch file submitit writes for `n_tasks` cells (an array when n_tasks > 1, as submitit does)."""
    from submitit.slurm.slurm import SlurmExecutor, _make_sbatch_string

    folder = Path(sub.folder).expanduser().absolute()  # what submitit's Executor stores
    # submitit's own command string, taken from its property on a stand-in (SlurmExecutor's
    # constructor refuses to run where there is no srun, and plan must work on any machine).
    command = SlurmExecutor._submitit_command_str.fget(types.SimpleNamespace(python=sub.python, folder=folder))
    params = dict(sub.parameters)
    if n_tasks > 1:
        params["map_count"] = n_tasks
    return _make_sbatch_string(command=command, folder=folder, **params)
