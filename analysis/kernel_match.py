"""Which kernels a run's two engines used: the one grouping key that separates the study from its floor.

    kernels_of(run)                 # "distinct" (the study) or "matched" (the zero-mismatch floor)
    only_kernels(data, MATCHED)     # the same SweepData (or list of runs) with only those runs

The run config's `engines.kernels` (fp8rl_core/config/run_config.py `EngineSpec.kernels`) reaches MLflow as the
child run's param `engines.kernels` (params are the flattened resolved config):
- `distinct`: each engine runs its own kernels. Claims 1–4, the summary table's rows, Figure 2, the
  tails and RL-evaluation tables, the step-0 evaluation offset: all of them read only these runs;
- `matched`: the trainer's log-prob pass replays the generation engine's computation, so bf16 and
  fp8_e2e log token_mult_prob_error = 1 exactly and fp8_gen keeps only its precision gap. Figure 1
  draws them as their own dashed curves and the report tables them (`analysis.floor`).
Runs logged before the key existed have no such param: they are `distinct` (what they ran).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TypeVar

from analysis.fetch import RunHistory, SweepData

KERNELS_PARAM = "engines.kernels"
DISTINCT, MATCHED = "distinct", "matched"
KERNELS = (DISTINCT, MATCHED)

Data = TypeVar("Data", SweepData, Sequence[RunHistory])


def kernels_of(run: RunHistory) -> str:
    """`distinct` or `matched` from the run's param; a run without it (an older run) is `distinct`."""
    return run.params.get(KERNELS_PARAM) or DISTINCT


def only_kernels(data: Data, kernels: str = DISTINCT) -> Data:
    """The runs with `kernels_of(run) == kernels`: a SweepData stays a SweepData, a sequence a list."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels: {kernels!r} is invalid; expected one of: {', '.join(KERNELS)}")
    if isinstance(data, SweepData):
        return dataclasses.replace(data, runs=[r for r in data.runs if kernels_of(r) == kernels])
    return [r for r in data if kernels_of(r) == kernels]
