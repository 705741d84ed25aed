"""Process control of the sweep engine, in one place: signals, launching a detached driver, finding
and stopping processes by pid.

Why one module: a driver that must stop cleanly on SIGTERM, local jobs cancelled with SIGINT, a
background driver in its own session and `sweep cancel` signalling a driver by the pid in its lock
file are one story (who may signal whom, and how each side reacts). Stdlib only, so that the
executors (which may import nothing of `run/`) and the driver share it.

    with stop_on_sigterm(): ...                 # SIGTERM raises DriverStopped in the main thread
    pid = spawn_detached(argv, cwd, log_path)   # its own session: it survives the shell
    interrupt(pid); still = terminate([pid], wait_s=40, alive=is_sweep_driver)
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any


class DriverStopped(Exception):
    """SIGTERM (e.g. `sweep cancel` stopping a detached driver) or Ctrl-C."""


def _raise_stopped(signum: int, frame: Any) -> None:
    raise DriverStopped(signal.Signals(signum).name)


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """SIGTERM (`sweep cancel` stopping this driver) raises DriverStopped in the main thread, so the
    driver's loop stops its local jobs and saves its state like on Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def restore_sigint() -> None:
    """Give SIGINT back its KeyboardInterrupt handler when this process inherited it as ignored.

    Why: `nohup sweep run ... &` and `&` in non-interactive shells start a process with SIGINT
    ignored, and exec'd children inherit that. Local cancellation is SIGINT to each submitit
    controller (which turns it into KeyboardInterrupt and stops its task), so under an ignored
    SIGINT `sweep cancel` and Ctrl-C would silently do nothing. A Python handler here is reset to
    the default on exec, so every process we start can be cancelled again. Main thread only.
    """
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def spawn_detached(argv: Sequence[str], cwd: Path, log_path: Path) -> int:
    """Start `argv` in its own session (a shell's hangup or Ctrl-C does not reach it), its output
    appended to `log_path`; its pid."""
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(list(argv), cwd=cwd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return proc.pid


def cmdline(pid: int) -> list[str] | None:
    """The pid's argv, or None when it is gone or a zombie (a dead child not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return None
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except (OSError, IndexError):
        return None


def is_sweep_driver(pid: int) -> bool:
    """True when `pid` is a live `sweep` driver other than this process (a pid read from a lock file
    may belong to another program by now)."""
    argv = cmdline(pid)
    return bool(argv) and any("launchers" in a or a.endswith("sweep") for a in argv) and pid != os.getpid()


def interrupt(pid: int) -> None:
    """SIGINT: how a submitit local controller is cancelled (it stops its task, then exits)."""
    try:
        os.kill(pid, signal.SIGINT)
    except ProcessLookupError:
        pass


def terminate(pids: Sequence[int], wait_s: float, alive: Callable[[int], bool]) -> list[int]:
    """SIGTERM each pid and wait until `alive(pid)` is False for all; the pids still alive after `wait_s`."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait_s
    left = list(pids)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [p for p in left if alive(p)]
    return left
