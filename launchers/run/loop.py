"""The sweep loop, one for grids and searches: admit cells from a source (`cell_sources.py`: a fixed grid,
or Optuna trials), keep their jobs submitted within the executor's slots, poll them all once per tick,
settle the ones that ended (retry or give up) and print progress.

    source = GridSource(session)                      # or TrialSource(session, study)
    rc = SweepLoop(session, source).drive(source.initial())   # when no cell is queued or running

Progress is one line per change (or every PROGRESS_EVERY_S), readable in a terminal and in a log:

    [02:13] 12 cells: 4 pending, 2 running, 5 done, 1 failed | 3fa1c2 14/60, 9b0e77 3/60 | ETA 6m40s
"""
from __future__ import annotations

import time

from fp8rl_core.tracking.lifecycle import PARENT_STOPPED
from launchers.executors import JobHandle, Task, is_alive
from launchers.plan import rules
from launchers.plan.cells import Cell
from launchers.process import DriverStopped
from launchers.run.cell_sources import CellSource
from launchers.run.progress import cell_step, error_tail, eta_seconds, fmt_duration
from launchers.run.session import SweepSession

PROGRESS_EVERY_S = 30.0
CANCEL_WAIT_S = 20.0
MAX_SHOWN = 4  # running cells listed on the progress line


class SweepLoop:
    def __init__(self, session: SweepSession, source: CellSource):
        self.session, self.source = session, source
        self.active: dict[str, JobHandle] = {}  # cell id -> its alive job
        self.queue: list[tuple[Task, str | None]] = []  # (a cell's task, its sbatch dependency): its run exists
        self.stages: list[JobHandle] = []  # warm-start jobs the queued cells wait for (SLURM)
        self.finished: set[str] = set()
        self.failed: set[str] = set()
        self.t0 = time.time()
        self._last_key, self._last_print = "", 0.0

    # ---- cells in ----------------------------------------------------------------------------------
    def admit(self, cells: list[Cell]) -> list[Cell]:
        """Survey `cells` (one poll, one MLflow query): watch the alive jobs, close the ones that need
        nothing; the cells to run (the caller launches them)."""
        for cell in cells:
            self.session.add_cell(cell)
        actions, watch = self.session.assess([c.id for c in cells])
        self.source.admitted(actions)
        self.active.update(watch)
        for cell in cells:
            if actions[cell.id] == rules.SKIP:  # finished before: counted done
                self.finished.add(cell.id)
                self.source.ended(cell, True)
            elif actions[cell.id] == rules.EXHAUSTED:  # retries used up before this driver: not re-run
                self.source.ended(cell, False)
        return [c for c in cells if actions[c.id] == rules.RUN]

    def take(self, cells: list[Cell]) -> None:
        """Admit the cells that are not in flight yet and launch the ones to run (warm start first)."""
        fresh = [c for c in cells if c.id not in self.active and c.id not in {t.name for t, _ in self.queue}]
        fresh = list({c.id: c for c in fresh}.values())  # two trials of one cell: one job
        if fresh:
            to_run = self.admit(fresh)
            if to_run:
                self.launch(to_run, self.session.warm_start(to_run))

    def launch(self, cells: list[Cell], warm_start_job: str | None) -> None:
        """Create every cell's child run now (the UI lists them SCHEDULED), queue them, submit what fits."""
        dependency = f"afterok:{warm_start_job}" if warm_start_job else None
        if warm_start_job:
            stage = next(s for s in self.session.state.stages if s.job_id == warm_start_job)
            self.stages.append(JobHandle(stage.name, stage.job_id, stage.kind, None, stage.stderr))
        tags = {c.id: self.source.tags(c) for c in cells}
        self.queue += [(t, dependency) for t in self.session.tasks_for(cells, tags)]
        self.submit_some()

    def submit_some(self) -> None:
        """Submit as many queued cells as the executor has slots for, as one batch of one dependency."""
        ex = self.session.executor
        n = ex.slots(sum(h.kind == ex.kind for h in self.active.values()))
        if n <= 0 or not self.queue:
            return
        dependency = self.queue[0][1]
        batch = [t for t, dep in self.queue if dep == dependency][:n]
        names = {t.name for t in batch}
        self.queue = [(t, dep) for t, dep in self.queue if t.name not in names]
        for h in self.session.submit(batch, dependency):
            self.active[h.name] = h
            self.source.submitted(self.session.by_id[h.name], h)

    # ---- the loop ----------------------------------------------------------------------------------
    def drive(self, initial: list[Cell]) -> int:
        """The whole sweep: take `initial`, run, and end as the source says (its exit code); 130 when
        stopped (Ctrl-C, or SIGTERM from `sweep cancel`)."""
        try:
            self.take(initial)
            self.run()
        except (KeyboardInterrupt, DriverStopped) as e:
            self.stop(str(e) or "interrupted")
            return 130
        return self.source.finish()

    def run(self) -> None:
        """Until the source has nothing more and no cell is queued or in flight."""
        while True:
            self.take(self.source.more())
            self.submit_some()
            if not (self.queue or self.active):
                return
            time.sleep(self.session.poll_s)
            self.tick()

    def tick(self) -> None:
        states = self.session.poll([*self.active.values(), *self.stages])
        self._watch_stages(states)
        ended = [cid for cid, h in self.active.items() if not is_alive(states.get(h.job_id))]
        if ended:
            mlflow = self.session.mlflow_states()  # after the poll: an ended job's run status is final
            for cid in ended:
                self._settle(cid, mlflow.get(cid), states.get(self.active.pop(cid).job_id))
            self.session.save()
        self.render(states)

    def _watch_stages(self, states: dict[str, str]) -> None:
        for stage in [s for s in self.stages if not is_alive(states.get(s.job_id))]:
            if states.get(stage.job_id) != "done":
                self.session.say(f"warm start job {stage.job_id} {states.get(stage.job_id)}: "
                                 f"{error_tail(stage.stderr) or 'no log'}; SLURM cancels the cells waiting for it")
            self.stages.remove(stage)

    def _settle(self, cid: str, status: str | None, job_state: str | None) -> None:
        """The cell's job ended: finished, to retry, or failed for good."""
        rec = self.session.state.record(cid)
        self.session.changes += 1
        self.session.settle_cell(cid, status, job_state)
        action = rules.decide(status, rec, None, self.session.retries)
        cell = self.session.by_id[cid]
        if action == rules.SKIP:
            self.finished.add(cid)
            self.source.ended(cell, True)
            return
        err = self.session.error_of(cid)
        if action == rules.RUN:
            self.session.say(f"cell {cid} {cell.label()} failed (attempt {len(rec.attempts)}): {err}; retrying")
            self.launch([cell], self.session.warm_start([cell]))  # the warm start is cached: usually a no-op
        else:
            self.session.say(f"cell {cid} {cell.label()} failed (attempt {len(rec.attempts)}, no retries left): {err}")
            self.failed.add(cid)
            self.source.ended(cell, False)

    # ---- progress ----------------------------------------------------------------------------------
    def render(self, states: dict[str, str]) -> None:
        session = self.session
        running = {cid: h for cid, h in self.active.items() if states.get(h.job_id) == "running"}
        pending = len(self.queue) + len(self.active) - len(running)
        steps = {cid: cell_step(session.cell_dir(cid)) for cid in self.active}
        shown = ", ".join(f"{cid[:6]} {max(steps[cid].step, 0)}/{session.by_id[cid].config.train.steps}"
                          for cid in list(running)[:MAX_SHOWN])
        more = f" +{len(running) - MAX_SHOWN}" if len(running) > MAX_SHOWN else ""
        key = (f"{len(session.cells)} cells: {pending} pending, {len(running)} running, {len(self.finished)} done, "
               f"{len(self.failed)} failed" + (f" | {shown}{more}" if shown else ""))
        now = time.time()
        if key == self._last_key and now - self._last_print < PROGRESS_EVERY_S:
            return
        remaining = sum(session.by_id[t.name].config.train.steps for t, _ in self.queue) + sum(
            session.by_id[cid].config.train.steps - max(0, st.step) for cid, st in steps.items())
        eta = eta_seconds(remaining, [st.seconds_per_step() for st in steps.values()],
                          min(session.sweep.launcher.max_parallel, len(self.queue) + len(self.active)))
        session.say(f"[{fmt_duration(now - self.t0)}] {key}" + (f" | ETA {fmt_duration(eta)}" if remaining else ""))
        self._last_key, self._last_print = key, now

    # ---- Ctrl-C / SIGTERM ----------------------------------------------------------------------------
    def stop(self, why: str) -> None:
        """Local jobs end with the driver (their runs KILLED, attempts not counted as failures);
        SLURM jobs keep running on the cluster (`sweep status`, `sweep cancel` find them)."""
        session = self.session
        local = [h for h in self.active.values() if h.kind == "local"]
        if local:
            from launchers.run.cancel import cancel_handles

            cancel_handles(session.sweep, session.state, local, session.executors, CANCEL_WAIT_S)
            session.say(f"stopped ({why}): {len(local)} local job(s) cancelled; `sweep run` again resumes them")
        others = len(self.active) - len(local)
        if not others:  # nothing of the sweep runs any more
            session.end_sweep(PARENT_STOPPED)
        else:
            session.say(f"stopped ({why}): {others} job(s) keep running; follow them with `sweep status "
                        f"{session.sweep.name} --watch`, stop them with `sweep cancel {session.sweep.name}`")
        session.save()
