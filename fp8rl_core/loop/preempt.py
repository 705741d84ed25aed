"""The time-limit signal: checkpoint at the next step boundary, then hand over to the requeue.

    with TimeLimit(mesh) as limit:
        for step in ...:
            ...one GRPO step, its metrics, its periodic checkpoint...
            limit.stop_here(step, checkpoint)   # returns, or checkpoints and exits

SLURM sends USR2 `launcher.slurm.signal_delay_s` before a job's time limit (and on preemption) to
every task. submitit's own handler (installed before the cell runs) would requeue the job there and
then, in the middle of a step: everything since the last periodic checkpoint would be lost (up to
`train.checkpoint_every` steps per requeue). So while the loop runs, USR2 only raises a flag; at the
next step boundary the ranks agree on it (one all-reduce of one number: the signal reaches the tasks
at slightly different moments, and a checkpoint is a collective every rank must enter at the same
step), write a checkpoint of that step (unless the periodic one just did), and only then call the
handler that was there before: submitit's, which on rank 0 calls `CellJob.checkpoint`, requeues the
job and exits (SystemExit), and on the other ranks returns, after which they exit too. The requeued
job resumes from that checkpoint: no step is lost. The signal delay must cover one step (validation
included) plus the checkpoint; a signal with no handler before ours ends the run the same way after
the checkpoint (SystemExit).
"""
from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from fp8rl_core.distributed.mesh import Mesh

SIGNAL = signal.SIGUSR2  # submitit's timeout/preemption signal (`#SBATCH --signal=USR2@<delay>`)


class TimeLimit:
    """USR2 -> a flag while the loop runs; the previous handler is restored on exit."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self.requested = False
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> TimeLimit:
        # signal.signal works in the main thread only (a test may run a loop in another thread)
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(SIGNAL, self._note)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(SIGNAL, self._previous)
            self._installed = False

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True  # nothing else in a handler: it interrupts the loop at any bytecode

    def agreed(self) -> bool:
        """Collective on several ranks: True on every rank when any rank got the signal."""
        if not self.mesh.distributed:
            return self.requested
        return bool(self.mesh.all_reduce_max([float(self.requested)])[0] > 0)

    def stop_here(self, step: int, checkpoint: Callable[[int], None], checkpointed: bool) -> None:
        """At the end of `step`: return when no rank got the signal; else checkpoint `step` (unless
        `checkpointed`: the periodic checkpoint of this step is already on disk), restore and call the
        previous handler (submitit's requeue), and exit."""
        if not self.agreed():
            return
        if not checkpointed:
            checkpoint(step)
        previous = self._previous
        self.__exit__()
        print(f"time limit (SIG{SIGNAL.name[3:]}): checkpointed step {step}, handing over to the requeue",
              flush=True)
        if callable(previous):
            previous(SIGNAL, None)  # submitit: rank 0 requeues and exits; other ranks return
        raise SystemExit(f"stopped after step {step} on SIG{SIGNAL.name[3:]} (time limit): resumes from its checkpoint")
