"""The chaos probe of issue 24 as a test: `kill -9` of a local sweep's driver (its whole process group,
cells included) mid-run, a restart, `kill -9` of one cell, and the same `sweep run` must finish the
sweep with every step in MLflow exactly once and no record rejected.

Real local executor, real core (tiny preset), real MLflow SQLite store. Nothing depends on machine
speed: the cells are held after a known step (fp8rl_core.loop.hold, FP8RL_HOLD_AFTER_STEP) and the
test kills only once every cell has entered the hold, after that step's checkpoint.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _sweep_fakes import tiny_core_base, wait_for, write_sweep
from mlflow import MlflowClient

from fp8rl_core.loop.hold import ENV_VAR, HELD_SUFFIX, holders
from launchers.run.state import load_state
from launchers.sweepfile.loading import load_sweep

STEPS = 4
# The warm-start cache stays relative (the default, `.fp8rl/warmstart`): the driver makes it absolute
# for its jobs, and a record that logs it otherwise is what MLflow rejected in the probe.
SWEEP = "experiment: chaos\n" + tiny_core_base(steps=STEPS) + """\
grid:
  recipe: [bf16, fp8_e2e]
launcher: {kind: local, max_parallel: 2, retries: 1}
tracking: {uri: "sqlite:///mlflow.db"}
"""
WAIT_S = 300  # a bound on a stuck test, not a speed assumption


def start_driver(cwd: Path, path: Path, hold: str, log: Path) -> subprocess.Popen:
    """`sweep run` in a process group of its own (its local cells join it), like a terminal's job."""
    env = {**os.environ, ENV_VAR: hold}
    with log.open("a") as f:
        return subprocess.Popen([sys.executable, "-m", "launchers.cli", "run", str(path)], cwd=cwd, env=env,
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def held_pids(release: Path) -> list[int]:
    return [int(p.name.rsplit(".", 1)[1]) for p in release.parent.glob(f"{release.name}{HELD_SUFFIX}*")]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").exists() and open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"


def hold_both(driver: subprocess.Popen, release: Path, log: Path) -> None:
    def both_held() -> bool:
        if driver.poll() is not None:
            pytest.fail(f"the driver ended (rc {driver.returncode}) before both cells were held:\n"
                        f"{log.read_text()[-3000:]}")
        return holders(release) == 2

    wait_for(both_held, WAIT_S, f"both cells to hold at {release.name}")


@pytest.mark.slow
def test_a_killed_driver_and_a_killed_cell_resume_in_one_sweep_run_with_every_step_once(cwd):
    path = write_sweep(cwd, SWEEP)
    log = cwd / "driver.log"

    # 1) kill -9 the driver's process group (driver, controllers, cells) while both cells hold after step 2
    first = cwd / "release-2"
    driver = start_driver(cwd, path, f"2:{first}", log)
    hold_both(driver, first, log)
    os.killpg(driver.pid, signal.SIGKILL)
    driver.wait()
    wait_for(lambda: all(gone(p) for p in held_pids(first)), 60, "the killed cells to be gone")

    # 2) restart; both cells resume and hold after step 3; kill -9 one of them, release the other
    second = cwd / "release-3"
    driver = start_driver(cwd, path, f"3:{second}", log)
    hold_both(driver, second, log)
    os.kill(held_pids(second)[0], signal.SIGKILL)
    second.touch()
    rc = driver.wait(timeout=WAIT_S)
    text = log.read_text()
    assert rc == 0, text[-3000:]  # this one `sweep run` finishes the sweep

    sweep = load_sweep(path)
    state = load_state(sweep.folder)
    outcomes = sorted([a.outcome for a in rec.attempts] for rec in state.cells.values())
    # the killed driver's attempts are lost (not counted); the killed cell's attempt failed and its
    # one retry finished; nothing else failed
    assert outcomes == [["lost", "failed", "finished"], ["lost", "finished"]], (outcomes, text[-3000:])
    # a job's log lines may land in its .err, its .out or (inherited) the driver's log: read them all
    logs = text + "".join(p.read_text() for p in (sweep.folder / "jobs").glob("*_log.*"))
    assert "rejected a record" not in logs and "Changing param values" not in logs, logs[-3000:]

    client = MlflowClient(sweep.tracking_uri())
    for rec in state.cells.values():
        run = client.get_run(rec.run_id)
        assert run.info.status == "FINISHED"
        cache = run.data.params["warmstart.cache_dir"]
        assert Path(cache).is_absolute(), cache  # one resolved config: what the job ran with
        for key in run.data.metrics:
            steps = [m.step for m in client.get_metric_history(rec.run_id, key)]
            assert len(steps) == len(set(steps)), (key, sorted(steps))
        loss = sorted(m.step for m in client.get_metric_history(rec.run_id, "token_mult_prob_error"))
        assert loss == list(range(1, STEPS + 1))
