"""How a run's FP8 GEMM executor is chosen at its start, and how the cells of a sweep share one choice.

    chosen = settle_executor("auto", "cpu", shared=Path("<sweep folder>/cells/fp8_executor.json"))

In order (the first that applies):
  pinned       fp8.gemm names an executor (part of the cell id): gemm.pin_executor, no calibration;
  env          $FP8RL_GEMM names one: no calibration;
  sweep        `shared` (a sweep cell: the run's builder passes the file beside the sweep's cell folders)
               holds the choice of the sweep's first cell to start: every later cell, and every resume, on
               any node, runs that one (a node that cannot run it stops the cell with the fix, rather than
               run another summation order under the same sweep);
  calibrated   on the CPU, this machine's calibration (calibrate.py: measured, or `cached` from an earlier
               run on this machine; `default` where $FP8RL_GEMM_CALIBRATE=0); for a sweep it is then written
               to `shared`, under an fcntl lock, so that cells starting together measure once;
  default      elsewhere (CUDA): the static rule, gemm.default_executor (scaled_mm on SM90).
The run logs the result as tags of the attempt (tracking/contract.py TAG_FP8_GEMM: the executor,
TAG_FP8_GEMM_CHOICE: how it was made), never as a param: under fp8.gemm auto it is not part of the cell id.
"""
from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from fp8rl_core.fp8 import calibrate, cpu_features, gemm

SHARED_FILE = "fp8_executor.json"  # in the folder of a sweep's cell folders (<launcher.folder>/cells)


class Choice(NamedTuple):
    executor: str
    how: str  # "pinned (fp8.gemm)", "$FP8RL_GEMM", "sweep (<file>: <timings> on <cpu>)", "calibrated: ...", ...


def settle_executor(gemm_key: str, device: torch.device | str, shared: Path | None = None,
                    calibrate_fn: Callable[[], calibrate.Calibration] = calibrate.calibrate) -> Choice:
    """Pin or decide this process's executor for `device` (see the module docstring). Raises ValueError for
    a pin it cannot honour and RuntimeError where the sweep's choice cannot run here."""
    gemm.pin_executor(gemm_key, device)
    kind = torch.device(device).type
    if gemm_key != "auto":
        how = "pinned (fp8.gemm)"
    elif os.environ.get(gemm.ENV_VAR):
        how = f"${gemm.ENV_VAR}"
    elif kind != "cpu":
        gemm.decide(device, None)
        how = f"default ({kind}: static rule)"
    else:
        name, how = _automatic(shared, calibrate_fn)
        gemm.decide(device, name)
    return Choice(gemm.select_executor(device), how)


def _automatic(shared: Path | None, calibrate_fn: Callable[[], calibrate.Calibration]) -> tuple[str, str]:
    if shared is None:
        cal = calibrate_fn()
        kind = "default" if not cal.timings_s else "cached" if cal.cached else "calibrated"
        return cal.executor, f"{kind}: {cal.describe()}"
    with calibrate.locked(shared):
        found = _read_shared(shared)
        if found is None:
            cal = calibrate_fn()
            found = {"executor": cal.executor, "cpu": calibrate.cpu_model(), "flags": cpu_features.kernel_flags(),
                     "calibration": cal.describe()}
            calibrate.write_json(shared, found)
    name = found["executor"]
    runnable = calibrate.candidates()
    if name not in runnable:
        raise RuntimeError(f"fp8.gemm auto: this sweep's cells run {name!r} ({shared}: chosen on {found['cpu']}, "
                           f"flags {found['flags']}), which this node cannot (flags {cpu_features.kernel_flags()}; "
                           f"runs {', '.join(runnable)}). Pin one executor for the sweep (fp8.gemm: emulated) or "
                           f"run its cells on one CPU type")
    return name, f"sweep ({shared}: {found['calibration']} on {found['cpu']})"


def _read_shared(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data["executor"] not in gemm.EXECUTORS or not all(isinstance(data[k], str) for k in
                                                             ("cpu", "flags", "calibration")):
            raise ValueError(f"executor {data['executor']!r}")
        return data
    except (OSError, ValueError, KeyError, TypeError) as e:
        warnings.warn(f"fp8rl: the sweep's FP8 GEMM choice {path} is unreadable ({type(e).__name__}: {e}); "
                      f"choosing again", stacklevel=3)
        return None


def note(gemm_key: str, device: torch.device | str) -> str:
    """How `fp8rl-train --print-config` says the executor will be chosen, measuring nothing."""
    kind = torch.device(device).type
    if gemm_key != "auto":
        return f"{gemm_key} (pinned by fp8.gemm)"
    if os.environ.get(gemm.ENV_VAR):
        return f"{os.environ[gemm.ENV_VAR]} (${gemm.ENV_VAR})"
    if kind != "cpu":
        return f"{gemm.default_executor(device)} (static rule on {kind})"
    if os.environ.get(calibrate.ENV_CALIBRATE, "1") in ("0", "false", "off"):
        return f"{gemm.default_executor(device)} (the default: ${calibrate.ENV_CALIBRATE}=0)"
    cal = calibrate.read_cached()
    if cal is None:
        return f"calibrated at run start (not cached here yet; default {gemm.default_executor(device)})"
    return f"{cal.executor} (cached calibration: {cal.describe()})"
