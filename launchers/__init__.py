"""The sweep engine. The data path reads from the folder names (docs/design.md):

    sweepfile/  the sweep file: schema, loading, overrides, run-config keys, search space (no side effects)
    plan/       cells and their ids, grid expansion, the rules table (state -> action), `sweep plan` text (pure)
    run/        the side effects: the session, the one sweep loop and its cell sources (grid, Optuna search),
                the driver, jobs, state file, status, cancel
    process.py  process control: signals, the background driver, stopping processes by pid
    executors/  where jobs run: local, debug, slurm/ (submitit; the sbatch mapping)
    cli.py      the `sweep` command

sweepfile/ and plan/ never import run/.
"""
