"""The memory plan of a sweep's cells: peak memory per rank from each model's config alone
(fp8rl_core.distributed.memory_plan; no weights are read), and the refusal of a cell that cannot fit what it asks.

What a rank has: on SLURM, a `device: cuda` cell's rank has one GPU of `launcher.slurm.gpu_mem_gb`;
a CPU cell's rank has `launcher.slurm.mem_gb / tasks_per_node` (mem_gb is per node; unset: nothing
to check) less CPU_PROCESS_BYTES. `device: auto` counts as cuda when the job asks for GPUs. Local and
debug cells request nothing, so they are estimated, never refused. A CUDA cell whose validation is estimated
to take over a quarter of its `parallel.timeout_s` on its busiest rank is refused too (issue 31, M3). A cell whose
model config cannot be read here (a `model.path` on a cluster disk) is shown `?`, not refused.
`sweep plan` and `sweep run` both call `refusal(sweep, cells)`: exit 2, nothing submitted.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from launchers.sweepfile.schema import SweepError

if TYPE_CHECKING:  # pragma: no cover
    from launchers.plan.cells import Cell
    from launchers.sweepfile.loading import Sweep

GiB = 2**30
# A CPU rank's process also holds the interpreter, torch and the tokenizer (about 0.3 GiB measured
# here for the tiny preset); the estimate counts tensors only, so a CPU rank's budget is its share of
# mem_gb less this.
CPU_PROCESS_BYTES = GiB // 2
VALIDATION_REFUSAL = "validation takes"  # how memory_plan.check_validation_time's refusal begins
TIME_KEY = "base.parallel.timeout_s"  # the sweep-file key that bounds it


@dataclass(frozen=True)
class CellMemory:
    peak: int | None  # bytes per rank (None: the model's config is not readable here)
    budget: int | None  # bytes per rank the cell requests (None: it requests nothing)
    key: str | None  # the sweep-file key that sets the budget
    why: str | None  # the refusal (memory_plan.check's text), or why there is no estimate

    @property
    def refused(self) -> bool:
        return self.peak is not None and self.why is not None

    def label(self) -> str:
        if self.peak is None:
            return "?"
        return f"{self.peak / GiB:.2f}" + (f"/{self.budget / GiB:.0f}" if self.budget else "") + " GiB"


def rank_budget(sweep: Sweep, device: str) -> tuple[int | None, str | None]:
    """(bytes per rank the cell requests, the key that sets it)."""
    la = sweep.launcher
    if la.kind != "slurm":
        return None, None
    if device == "cuda":
        return int(la.slurm.gpu_mem_gb * GiB), "launcher.slurm.gpu_mem_gb"
    if la.slurm.mem_gb is None:
        return None, None
    return max(int(la.slurm.mem_gb * GiB / la.slurm.tasks_per_node) - CPU_PROCESS_BYTES, 0), "launcher.slurm.mem_gb"


def cell_device(sweep: Sweep, device: str) -> str:
    """cpu or cuda: `device: auto` is cuda where the cell asks SLURM for GPUs, else the CPU."""
    if device in ("cpu", "cuda"):
        return device
    return "cuda" if sweep.launcher.kind == "slurm" and sweep.launcher.slurm.gpus_per_node else "cpu"


@functools.lru_cache(maxsize=256)
def _plan(path: str | None, preset: str, layout: Any, budget: int | None, timeout_s: float = float("inf")
          ) -> tuple[int | None, str | None]:
    """(peak, refusal or why there is no estimate) of one model (`model.path`, else the preset) and
    layout: cells that share both are planned once. The refusal: memory over `budget`, or validation's
    estimated time over a quarter of the collective timeout `timeout_s` (memory_plan.check_validation_time)."""
    from fp8rl_core.distributed.memory_plan import check, check_validation_time, plan_memory
    from fp8rl_core.model.config import PRESETS
    from fp8rl_core.model.sources import resolve_model_path

    try:
        plan = plan_memory(resolve_model_path(path) if path else PRESETS[preset], layout)
    except (OSError, ValueError, KeyError, TypeError) as e:  # config.json not on this machine, or not Llama-like
        return None, f"no estimate: {type(e).__name__}: {e}"
    return plan.peak, (check(plan, budget) if budget is not None else None) or check_validation_time(plan, timeout_s)


def cell_memory(sweep: Sweep, cell: Cell) -> CellMemory:
    from fp8rl_core.distributed.memory_plan import layout_for_run

    cfg = cell.config
    device = cell_device(sweep, cfg.device)
    budget, key = rank_budget(sweep, device)
    layout = layout_for_run(cfg, sweep.launcher.world_size, device=device)
    peak, why = _plan(str(cfg.model.path) if cfg.model.path else None, cfg.model.preset, layout, budget,
                      cfg.parallel.timeout_s)
    if why and why.startswith(VALIDATION_REFUSAL):  # the key whose value bounds it
        key = TIME_KEY
    return CellMemory(peak, budget, key, why)


def plan_cells(sweep: Sweep, cells: list[Cell]) -> dict[str, CellMemory]:
    """cell id -> its memory plan (cells sharing a model and layout are computed once)."""
    return {c.id: cell_memory(sweep, c) for c in cells}


def refusal(sweep: Sweep, cells: list[Cell], plans: dict[str, CellMemory] | None = None) -> SweepError | None:
    """The error of the first cell whose prompts cannot be split over its ranks, or that cannot fit
    its rank's memory (None: all fit or unknown)."""
    world = sweep.launcher.world_size
    split = [c for c in cells if c.config.rollout.prompts_per_step % world]
    if split:  # data parallel splits a step's prompts by whole GRPO groups (fp8rl_core/loop/builder.py)
        p = split[0].config.rollout.prompts_per_step
        key = "launcher.ranks_per_cell" if sweep.launcher.kind != "slurm" else "launcher.slurm.tasks_per_node"
        return SweepError("rollout.prompts_per_step", f"cell {split[0].id} {split[0].label()}: {p} prompts per step "
                          f"cannot be split by whole GRPO groups over {world} ranks ({key})",
                          f"a multiple of {world}, or a world size that divides {p}",
                          where=sweep.locator.where("base.rollout.prompts_per_step"))
    plans = plans if plans is not None else plan_cells(sweep, cells)
    bad = [c for c in cells if plans[c.id].refused]
    if not bad:
        return None
    first, mem = bad[0], plans[bad[0].id]
    la = sweep.launcher
    layout = (f"{la.world_size} rank(s): launcher.slurm.nodes {la.slurm.nodes} x tasks_per_node "
              f"{la.slurm.tasks_per_node}")
    more = f" (and {len(bad) - 1} more cell(s))" if len(bad) > 1 else ""
    verb = "cannot validate within its collective timeout" if mem.key == TIME_KEY else "cannot fit"
    return SweepError(mem.key or "launcher", f"cell {first.id} {first.label()}{more} {verb}, at {layout}: "
                      f"{mem.why}; nothing was submitted", where=sweep.locator.where(mem.key or "launcher"))
