"""What runs inside a job: one cell (`CellJob`), the warm-start stage, the report stage.

    CellJob()(config_dict)       # builds the RunConfig, runs (or resumes) it: fp8rl_core.loop.run.run

A cell's job is a `submitit.helpers.Checkpointable`. On preemption or timeout (USR2) the run loop
first finishes the step it is in and checkpoints it (fp8rl_core/loop/preempt.py), then hands the signal
to submitit's handler, which calls `checkpoint()` (it resubmits the same cell) and requeues the job
(at most `launcher.slurm.max_num_timeout` times at the time limit); the requeued job calls `run`
again, which resumes from the cell's own checkpoints (`<output_dir>/checkpoints`) and logs into the
same MLflow run (`tracking.run_id`), keeping the first value of each step (none lost or doubled).
A plain `scontrol requeue` (SIGTERM, which submitit ignores) restarts the original submission: the
same config, so the same resume. The config travels as a plain dict and is validated again in the
job, so a requeue after a code update still fails loudly on a config the new code rejects.

Several ranks (a SLURM job with nodes x tasks_per_node tasks, or a local cell on
`launcher.ranks_per_cell` processes): submitit (or the local launcher) runs `CellJob` on every task;
every rank calls `fp8rl_core.loop.run.run`, which joins the process group from the environment. Only
global rank 0 marks the MLflow run (a peer's collective error after rank 0 died must not overwrite
rank 0's outcome) and only rank 0's USR2 handler checkpoints and requeues (submitit's own rule: the
other tasks' handlers return, and SLURM stops and restarts every task with the requeued job).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import submitit

from fp8rl_core.config import RunConfig, run_config_from_dict
from fp8rl_core.tracking import METRICS_FILE
from fp8rl_core.tracking.lifecycle import Lifecycle, grid_parent_status
from fp8rl_core.tracking.runs import cell_states
from launchers.run.sweep_report import finished_count, write_report

log = logging.getLogger(__name__)

RunFn = Callable[[RunConfig], Any]


def core_run(cfg: RunConfig) -> dict[str, float]:
    from fp8rl_core.loop.run import run

    return run(cfg, progress=False)  # progress comes from metrics.jsonl; a bar would bury the error in the log


def export_local_ranks(environ: dict[str, str] | None = None) -> None:
    """A local cell of several ranks (launchers.executors.local: one submitit controller, N tasks):
    RANK, WORLD_SIZE, LOCAL_RANK from submitit's task ids, so that fp8rl_core.distributed.env joins
    the group as under torchrun (MASTER_ADDR/PORT come from the executor). No-op elsewhere."""
    import os

    env = os.environ if environ is None else environ
    if env.get("SUBMITIT_EXECUTOR") != "local" or int(env.get("SUBMITIT_LOCAL_NTASKS", "1")) <= 1:
        return
    env["RANK"] = env["SUBMITIT_LOCAL_GLOBALID"]
    env["LOCAL_RANK"] = env["SUBMITIT_LOCAL_LOCALID"]
    env["WORLD_SIZE"] = env["LOCAL_WORLD_SIZE"] = env["SUBMITIT_LOCAL_NTASKS"]
    env.setdefault("MASTER_ADDR", "127.0.0.1")


def global_rank() -> int:
    """This process's rank in its cell (0 when the cell runs as one process): torchrun/local ranks'
    RANK, else a multi-task SLURM job's SLURM_PROCID (fp8rl_core.distributed.env)."""
    from fp8rl_core.distributed.env import detect_rank_env

    return detect_rank_env().rank


def _mark_run(cfg: RunConfig, error: BaseException, requeued: bool) -> None:
    """Best effort: the cell's MLflow run marked as the lifecycle says for `error`
    (fp8rl_core.tracking.lifecycle.job_status: RUNNING again after a requeue, KILLED on a cancel,
    FAILED with the error tagged), after shipping what the cell logged; a run that already ended
    itself is left as it is.

    run() marks its run only once its sink is open; a cell that fails before (a config the model
    cannot build, a missing file) would stay SCHEDULED without this."""
    uri, run_id = cfg.tracking.uri, cfg.tracking.run_id
    if not uri or not run_id or global_rank() != 0:  # rank 0 alone talks to MLflow
        return
    try:
        Lifecycle(uri).job_ended(run_id, error, requeued, Path(cfg.output_dir) / METRICS_FILE)
    except Exception as e:  # never hide the cell's own error behind a tracking error
        log.warning("could not mark MLflow run %s after %s: %s", run_id, type(error).__name__, e)


class CellJob(submitit.helpers.Checkpointable):
    """Run one cell from its resolved config (a dict of fp8rl_core.config.RunConfig).

    `run_fn` replaces fp8rl_core.loop.run.run (tests use a tiny fake cell)."""

    def __init__(self, run_fn: RunFn | None = None):
        self.run_fn = run_fn
        self._requeued = False

    def __call__(self, config: dict[str, Any]) -> Any:
        export_local_ranks()
        cfg = run_config_from_dict(config, where="cell job")
        _say_start(cfg)
        try:
            return (self.run_fn or core_run)(cfg)
        except BaseException as e:  # SystemExit after a requeue, KeyboardInterrupt (cancel), the cell's error
            _mark_run(cfg, e, requeued=self._requeued)
            raise

    def checkpoint(self, config: dict[str, Any]) -> submitit.helpers.DelayedSubmission:
        """Resubmit the same cell. The run's state is its own checkpoint on disk: the run loop wrote
        one for the step it had just finished before it handed the signal here (loop/preempt.py)."""
        self._requeued = True
        return submitit.helpers.DelayedSubmission(CellJob(self.run_fn), config)


def _say_start(cfg: RunConfig) -> None:
    """One line in the job's log: where this attempt starts (a requeued job resumes)."""
    import os

    from fp8rl_core.io.checkpoint import latest_checkpoint

    found = latest_checkpoint(Path(cfg.output_dir) / "checkpoints")
    restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
    rank = global_rank()
    print(f"cell job: run {cfg.tracking.run_id}, {'resuming from ' + found.name if found else 'starting'}"
          f" (SLURM_RESTART_COUNT={restarts})" + (f" [rank {rank}]" if rank else ""), flush=True)


def warm_start_stage(configs: list[dict[str, Any]], progress: bool = True) -> list[str]:
    """Make (or find in the cache) the warm-start checkpoint of each config; the folders' paths.
    `progress`: a tqdm bar on stderr (minutes of work: the terminal locally, the job's log on SLURM)."""
    from fp8rl_core.loop.builder import initial_checkpoint, resolve_setup

    paths = []
    for data in configs:
        cfg = run_config_from_dict(data, where="warm-start stage")
        # the warm start trains on the CPU, whatever device the cell runs on
        paths.append(str(initial_checkpoint(resolve_setup(cfg, "cpu"), progress=progress)))
    return paths


def warm_start_configs(configs: list[RunConfig]) -> list[RunConfig]:
    """One config per distinct warm start the cells need and the cache does not hold yet."""
    from fp8rl_core.loop.warmstart import warmstart_key

    todo: dict[str, RunConfig] = {}
    for cfg in configs:
        if cfg.model.path or cfg.warmstart.steps == 0:
            continue
        key = warmstart_key(cfg)
        if key not in todo and not (Path(cfg.warmstart.cache_dir) / key / "config.json").exists():
            todo[key] = cfg
    return list(todo.values())


def report_stage(uri: str, experiment: str, sweep_name: str, out_dir: str, parent_run_id: str,
                 n_cells: int, analysis: dict[str, Any] | None = None, cell_ids: list[str] | None = None) -> str:
    """Figures, table and claims of the sweep, logged to its parent run, which is then ended:
    FINISHED when all `n_cells` cells finished, else FAILED. `analysis`: the sweep file's `analysis:`
    block; `cell_ids`: its cells when submitted (child runs of other cells, from an earlier version of
    the file, are left out of the report). Returns the report's path; the verdicts go to the job's log."""
    try:
        paths = write_report(uri, experiment, sweep_name, out_dir, parent_run_id, analysis, cell_ids)
        print(paths.verdicts_text, flush=True)
    finally:
        done = finished_count(cell_states(uri, experiment, sweep_name), cell_ids)
        Lifecycle(uri).sweep_ended(parent_run_id, grid_parent_status(done, n_cells))
    return str(paths.report)
