"""The `sweep` command: plan, run, status, report, cancel, server.

    sweep plan sweeps/fp8_ablation.yaml                      # the cells, their state, nothing launched
    sweep plan sweeps/fp8_ablation.yaml launcher=slurm max_parallel=8 base.train.steps=5
    sweep plan sweeps/fp8_ablation_llama8b.yaml --preflight    # + each cell's FP8 GEMM shapes, checked here
    sweep run sweeps/fp8_ablation.yaml [--detach]             # run what is not finished; again to resume
    sweep status sweeps/fp8_ablation.yaml --watch              # from any shell
    sweep report sweeps/fp8_ablation.yaml                      # figures, table, claims (also mid-sweep)
    sweep cancel sweeps/fp8_ablation.yaml
    sweep server --port 5000                                   # MLflow server on 127.0.0.1

Each verb is one function registered with `@command(name, help, *argument adders)`; it takes the
parsed arguments and returns the exit code. A bad sweep file or override exits 2 with
`file:line: key: what is wrong; valid: ...` before anything is created.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from fp8rl_core.config.schema import ConfigError
from fp8rl_core.tracking.runs import find_parent_run
from fp8rl_core.tracking.server import start_server
from fp8rl_core.tracking.store import TrackingUnreachable, absolute_uri
from launchers.plan import render as plan_text
from launchers.plan.grid import expand_grid
from launchers.run.sweep_report import write_report
from launchers.sweepfile.loading import Sweep, load_sweep

Handler = Callable[[argparse.Namespace], int]
ArgAdder = Callable[[argparse.ArgumentParser], None]
COMMANDS: dict[str, tuple[str, tuple[ArgAdder, ...], Handler]] = {}


def command(name: str, help: str, *adders: ArgAdder) -> Callable[[Handler], Handler]:
    """Register `sweep NAME`: the decorated function gets the parsed args and returns the exit code."""
    def register(fn: Handler) -> Handler:
        COMMANDS[name] = (help, adders, fn)
        return fn
    return register


def sweep_file_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="the sweep file (YAML), e.g. sweeps/fp8_ablation.yaml")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="changes to the file: launcher=slurm max_parallel=8 base.train.steps=5 grid.seed=[0,1,2]")


def load(args: argparse.Namespace) -> Sweep:
    return load_sweep(args.file, args.overrides)


def load_for_work(args: argparse.Namespace) -> Sweep:
    """`load`, plus what only the verbs that plan or start cells check (not status, report or cancel,
    which must work on any sweep): a `model.path` that is not here (launchers.plan.model_paths)."""
    from launchers.plan.model_paths import check_model_paths

    sweep = load(args)
    warning = check_model_paths(sweep)
    if warning:
        print(warning, file=sys.stderr)
    return sweep


@command("plan", "show the cells, their state and what `run` would do; launch nothing", sweep_file_args,
         lambda p: p.add_argument("--all", action="store_true", help="list every cell (default: the first 200)"),
         lambda p: p.add_argument("--preflight", action="store_true",
                                  help="list the FP8 GEMM shapes each cell checks before its first step and check "
                                       "them here (a CPU: at a small M only); exit 1 if one fails"))
def plan(args: argparse.Namespace) -> int:
    from launchers.plan.memory import plan_cells, refusal

    sweep = load_for_work(args)
    expansion = None if sweep.spec.search is not None else expand_grid(sweep)
    max_rows = None if args.all else plan_text.DEFAULT_MAX_ROWS
    memory = plan_cells(sweep, expansion.cells) if expansion is not None else None
    sys.stdout.write(plan_text.render_plan(sweep, expansion, STATE_PROVIDER(sweep), max_rows, memory))
    if args.preflight:
        from launchers.plan.preflight import preflight_section

        text, failed = preflight_section(sweep, expansion.cells) if expansion is not None else (
            "\n--preflight: a search's cells are not known before it runs\n", False)
        sys.stdout.write(text)
        if failed:
            return 1
    refused = refusal(sweep, expansion.cells, memory) if expansion is not None else None
    if refused is not None:  # the plan is shown, then refused: `sweep run` would submit nothing
        raise refused
    return 0


def _plan_states(sweep: Sweep) -> plan_text.StateProvider:
    from launchers.run.status import plan_states

    return plan_states(sweep)


STATE_PROVIDER = _plan_states  # MLflow's states (+ retries used up) for `plan`


@command("run", "run the cells that are not finished; show progress; run it again to resume", sweep_file_args,
         lambda p: p.add_argument("--detach", action="store_true",
                                  help="return at once, the sweep goes on: a SLURM grid is submitted (cells + "
                                       "report stage), any other sweep keeps its driver in the background"),
         lambda p: p.add_argument("--retry-failed", action="store_true",
                                  help="also re-run cells (and search trials) that used up their retries"))
def run(args: argparse.Namespace) -> int:
    sweep = load_for_work(args)
    if sweep.spec.search is not None:
        from launchers.run.search import run_search

        return run_search(sweep, detach=args.detach, retry_failed=args.retry_failed)
    from launchers.run.driver import run_sweep

    return run_sweep(sweep, detach=args.detach, retry_failed=args.retry_failed)


@command("status", "show each cell's state, step and error (MLflow + the scheduler, one query each)",
         sweep_file_args,
         lambda p: p.add_argument("--watch", action="store_true", help="refresh until nothing is pending or running"),
         lambda p: p.add_argument("--interval", type=float, default=5.0, help="seconds between refreshes (--watch)"))
def status(args: argparse.Namespace) -> int:
    from launchers.run.status import sweep_status

    try:
        return sweep_status(load(args), watch=args.watch, interval_s=args.interval)
    except TrackingUnreachable as e:
        print(f"sweep status: {e}", file=sys.stderr)
        return 1


def _report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", help="output folder (default <sweep folder>/report)")
    p.add_argument("--json", action="store_true", help="print the claim verdicts as JSON (for scripts) instead")


@command("report", "figures, table and claim checks from MLflow (any time, also mid-sweep)", sweep_file_args,
         _report_args)
def report(args: argparse.Namespace) -> int:
    sweep = load(args)
    uri = sweep.tracking_uri()
    parent = find_parent_run(uri, sweep.experiment, sweep.experiment)
    if parent is None:
        print(f"sweep report: no runs of sweep {sweep.experiment!r} at {uri}; run it first", file=sys.stderr)
        return 1
    # a grid's cells as the file is now: child runs of cells it no longer has are left out (and counted);
    # a search's trials are whatever Optuna asked for, so every child run of its parent counts
    cell_ids = None if sweep.spec.search is not None else [c.id for c in expand_grid(sweep).cells]
    paths = write_report(uri, sweep.experiment, sweep.experiment, args.out or sweep.folder / "report", parent,
                         sweep.spec.analysis, cell_ids)
    if args.json:
        print(json.dumps(paths.verdicts, indent=2))
        return 0
    print(paths.verdicts_text)
    print(f"\nreport: {paths.report}")
    for path in paths.files()[1:]:
        print(f"  {path}")
    print(f"MLflow: {paths.ui_link}")
    return 0


@command("cancel", "cancel the sweep's queued and running jobs; their runs end KILLED", sweep_file_args)
def cancel(args: argparse.Namespace) -> int:
    from launchers.run.cancel import cancel_sweep

    return cancel_sweep(load(args), sys.stdout)


def _server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", default="sqlite:///mlflow.db",
                   help="backend store URI (default sqlite:///mlflow.db in this directory)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=5000)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--artifacts-destination", help="where the server keeps artifacts (default beside a SQLite store)")


@command("server", "start an MLflow tracking server (127.0.0.1 unless told otherwise); Ctrl-C stops it",
         _server_args)
def server(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    store = absolute_uri(args.store, Path.cwd())
    srv = start_server(store, args.artifacts_destination, host=args.host, port=args.port, workers=args.workers)
    print(f"MLflow server at {srv.url} (store {store}, log {srv.log_path})\n"
          f"jobs log to it with: sweep run FILE tracking.uri={srv.url}", flush=True)
    try:
        while srv.running():
            time.sleep(1.0)
        print(f"server exited:\n{srv.log_tail()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        srv.stop()
        return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sweep", description="FP8 RL sweeps: plan, run and report a sweep file.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help, adders, fn) in COMMANDS.items():
        p = sub.add_parser(name, help=help, description=help)
        for add in adders:
            add(p)
        p.set_defaults(handler=fn)
    return parser


def main(argv: list[str] | None = None) -> int:
    from launchers.process import restore_sigint

    restore_sigint()  # Ctrl-C and `sweep cancel` work even under `nohup ... &`
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except ConfigError as e:  # SweepError included: located `file:line: key: problem; valid: ...`
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
