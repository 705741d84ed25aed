"""The run loop (grid sweeps; the search drives its own trials): keep jobs submitted (within the
executor's slots), poll them all once per tick,
settle the ones that ended (retry or give up), and print progress.

Progress is one line per change (or every PROGRESS_EVERY_S), readable in a terminal and in a log:

    [02:13] 12 cells: 4 pending, 2 running, 5 done, 1 failed | 3fa1c2 14/60, 9b0e77 3/60 | ETA 6m40s
"""
from __future__ import annotations

import time

from fp8rl_core.tracking.store import retry_locked
from launchers.executors import JobHandle, Task, is_alive
from launchers.plan import rules
from launchers.plan.cells import Cell
from launchers.run.context import SweepRun
from launchers.run.progress import cell_step, error_tail, eta_seconds, fmt_duration

PROGRESS_EVERY_S = 30.0
CANCEL_WAIT_S = 20.0
MAX_SHOWN = 4  # running cells listed on the progress line


class Loop:
    def __init__(self, run: SweepRun, watch: dict[str, JobHandle], finished: set[str]):
        self.d = run
        self.active: dict[str, JobHandle] = dict(watch)  # cell id -> its alive job
        self.queue: list[Task] = []  # cells to submit: their child runs exist (SCHEDULED) already
        self.dependency: str | None = None
        self.stage: JobHandle | None = None  # the warm-start job the first batch waits for (SLURM)
        self.finished = set(finished)
        self.failed: set[str] = set()
        self.t0 = time.time()
        self._last_key, self._last_print = "", 0.0

    def launch(self, cells: list[Cell], warm_start_job: str | None) -> None:
        """Create every cell's child run now (the UI lists them SCHEDULED), submit what fits."""
        self.queue = self.d.tasks_for(cells)
        if warm_start_job:
            self.dependency = f"afterok:{warm_start_job}"
            stage = next(s for s in self.d.state.stages if s.job_id == warm_start_job)
            self.stage = JobHandle(stage.name, stage.job_id, stage.kind, None, stage.stderr)
        self.submit_some()

    def submit_some(self) -> None:
        n = self.d.executor.slots(sum(h.kind == self.d.executor.kind for h in self.active.values()))
        if n <= 0 or not self.queue:
            return
        batch, self.queue = self.queue[:n], self.queue[n:]
        for h in self.d.submit(batch, self.dependency):
            self.active[h.name] = h
        self.dependency = None  # later batches (retries) start after the warm start has run

    def loop(self) -> None:
        while self.queue or self.active:
            self.tick()
            self.submit_some()
            if self.queue or self.active:
                time.sleep(self.d.poll_s)

    def poll(self) -> dict[str, str]:
        return self.d.poll([*self.active.values(), *([self.stage] if self.stage else [])])

    def tick(self) -> None:
        states = self.poll()
        if self.stage is not None and not is_alive(states.get(self.stage.job_id)):
            if states.get(self.stage.job_id) != "done":
                self.d.say(f"warm start job {self.stage.job_id} {states.get(self.stage.job_id)}: "
                           f"{error_tail(self.stage.stderr) or 'no log'}; SLURM cancels the cells waiting for it")
            self.stage = None
        ended = [cid for cid, h in self.active.items() if not is_alive(states.get(h.job_id))]
        if ended:
            mlflow = self.d.mlflow_states()
            for cid in ended:
                self._settle(cid, mlflow, states.get(self.active.pop(cid).job_id))
            self.d.save()
        self.render(states)

    def _settle(self, cid: str, mlflow: dict[str, str], job_state: str | None) -> None:
        """The cell's job ended: finished, to retry, or failed for good."""
        rec = self.d.state.record(cid)
        status = mlflow.get(cid)
        self.d.changes += 1
        self.d.settle_cell(cid, status, job_state)
        action = rules.decide(status, rec, None, self.d.retries)
        cell = self.d.by_id[cid]
        if action == rules.SKIP:
            self.finished.add(cid)
            return
        err = self.d.error_of(cid)
        if action == rules.RUN:
            self.d.say(f"cell {cid} {cell.label()} failed (attempt {len(rec.attempts)}): {err}; retrying")
            self.queue += self.d.tasks_for([cell])
        else:
            self.d.say(f"cell {cid} {cell.label()} failed (attempt {len(rec.attempts)}, no retries left): {err}")
            self.failed.add(cid)

    # ---- progress ----------------------------------------------------------------------------------
    def render(self, states: dict[str, str]) -> None:
        running = {cid: h for cid, h in self.active.items() if states.get(h.job_id) == "running"}
        pending = len(self.queue) + len(self.active) - len(running)
        steps = {cid: cell_step(self.d.cell_dir(cid)) for cid in self.active}
        shown = ", ".join(f"{cid[:6]} {max(steps[cid].step, 0)}/{self.d.by_id[cid].config.train.steps}"
                          for cid in list(running)[:MAX_SHOWN])
        more = f" +{len(running) - MAX_SHOWN}" if len(running) > MAX_SHOWN else ""
        key = (f"{len(self.d.cells)} cells: {pending} pending, {len(running)} running, {len(self.finished)} done, "
               f"{len(self.failed)} failed" + (f" | {shown}{more}" if shown else ""))
        now = time.time()
        if key == self._last_key and now - self._last_print < PROGRESS_EVERY_S:
            return
        remaining = sum(self.d.by_id[t.name].config.train.steps for t in self.queue) + sum(
            self.d.by_id[cid].config.train.steps - max(0, s.step) for cid, s in steps.items())
        eta = eta_seconds(remaining, [s.seconds_per_step() for s in steps.values()],
                          min(self.d.sweep.launcher.max_parallel, len(self.queue) + len(self.active)))
        self.d.say(f"[{fmt_duration(now - self.t0)}] {key}" + (f" | ETA {fmt_duration(eta)}" if remaining else ""))
        self._last_key, self._last_print = key, now

    # ---- Ctrl-C / SIGTERM ----------------------------------------------------------------------------
    def stop(self, why: str) -> None:
        """Local jobs end with the driver (their runs KILLED, attempts not counted as failures);
        SLURM jobs keep running on the cluster (`sweep status`, `sweep cancel` find them)."""
        local = [h for h in self.active.values() if h.kind == "local"]
        if local:
            from launchers.run.cancel import cancel_handles

            cancel_handles(self.d.sweep, self.d.state, local, self.d.executors, CANCEL_WAIT_S)
            self.d.say(f"stopped ({why}): {len(local)} local job(s) cancelled; `sweep run` again resumes them")
        others = len(self.active) - len(local)
        if not others:  # nothing of the sweep runs any more
            from fp8rl_core.tracking.runs import finish_run

            retry_locked(finish_run, self.d.uri, self.d.state.parent_run_id, "KILLED")
        else:
            self.d.say(f"stopped ({why}): {others} job(s) keep running; follow them with `sweep status "
                        f"{self.d.sweep.name} --watch`, stop them with `sweep cancel {self.d.sweep.name}`")
        self.d.save()
