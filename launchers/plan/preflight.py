"""`sweep plan --preflight`: the FP8 GEMM shapes each cell checks before its first step, from each model's
config alone (config.json or a preset; no weights), and a check of those shapes on this machine.

The shapes are the cell's own (fp8rl_core.loop.builder.preflight_shapes: its recipe's FP8 sides on our
executors, at its M values on its device). The check (fp8rl_core/fp8/preflight.py, docs/design.md "FP8
GEMM preflight") runs here: on a GPU every listed shape; on a CPU each distinct (pass, K, N) at a small M
only (preflight.PLAN_CPU_MS; the CPU executor against the float64 reference), so an 8B model stays fast.
A shape that fails is printed with its error and `sweep plan` exits 1.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from fp8rl_core.fp8.preflight import GemmShape
    from launchers.plan.cells import Cell
    from launchers.sweepfile.loading import Sweep

NOTHING = "nothing to check (no FP8 GEMM on our executors: a BF16 side, vLLM, Megatron-Core or another format)"


def model_config_of(cfg: Any) -> Any:
    """The cell's model config: `model.path`'s config.json, else its preset (raises where unreadable)."""
    from fp8rl_core.distributed.memory_plan import load_model_config
    from fp8rl_core.model.config import PRESETS
    from fp8rl_core.model.sources import resolve_model_path

    return load_model_config(resolve_model_path(cfg.model.path) if cfg.model.path else PRESETS[cfg.model.preset])


def cell_shapes(sweep: Sweep, cell: Cell) -> tuple[list[GemmShape] | None, str]:
    """(the cell's shapes, what they come from); shapes None when its model config is not readable here."""
    from fp8rl_core.loop.builder import preflight_shapes
    from launchers.plan.memory import cell_device

    cfg = cell.config
    device = cell_device(sweep, cfg.device)
    source = f"model {cfg.model.path or 'preset ' + cfg.model.preset}, {device}, {sweep.launcher.world_size} rank(s)"
    try:
        model = model_config_of(cfg)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"{source}: model config not readable here ({type(e).__name__}: {e})"
    return preflight_shapes(cfg, model, sweep.launcher.world_size, device), source


def shape_table(shapes: list[GemmShape], indent: str = "    ") -> list[str]:
    rows = [("layer", "pass", "M", "K", "N", "blocks A x B")]
    rows += [(s.layer, s.pass_name, str(s.m), str(s.k), str(s.n), f"{s.block_a} x {s.block_b}") for s in shapes]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def to_check(groups: list[list[GemmShape]], on_gpu: bool) -> list[GemmShape]:
    """The distinct shapes to check here: all of them on a GPU; on a CPU each (pass, K, N) at PLAN_CPU_MS."""
    from fp8rl_core.fp8.preflight import PLAN_CPU_MS

    out: dict[tuple, GemmShape] = {}
    for shapes in groups:
        for s in shapes:
            for m in (s.m,) if on_gpu else PLAN_CPU_MS:
                out.setdefault((s.pass_name, m, s.k, s.n, s.block_a, s.block_b), dataclasses.replace(s, m=m))
    return list(out.values())


def preflight_section(sweep: Sweep, cells: list[Cell]) -> tuple[str, bool]:
    """(the text of `sweep plan --preflight`, whether a shape failed here)."""
    import torch

    from fp8rl_core.fp8.preflight import PreflightError, run_preflight

    groups: dict[tuple, tuple[list[GemmShape] | None, str, list[str]]] = {}
    for cell in cells:
        shapes, source = cell_shapes(sweep, cell)
        key = (None if shapes is None else tuple(shapes), source if shapes is None else "")
        groups.setdefault(key, (shapes, source, []))[2].append(f"{cell.id} {cell.label()}")
    lines = ["", "FP8 GEMM preflight (--preflight): the GEMMs each cell checks before its first step, "
                 "from its model's config alone"]
    for shapes, source, ids in groups.values():
        head = f"  {len(ids)} cell(s): " + ", ".join(ids[:4]) + (", ..." if len(ids) > 4 else "")
        if shapes is None:
            lines += [head, f"    ? {source}"]
        elif not shapes:
            lines += [head, f"    {NOTHING}"]
        else:
            lines += [head, f"    {len(shapes)} shapes ({source}):", *shape_table(shapes, "      ")]
    checks = [s for s, _, _ in groups.values() if s]
    if not checks:
        return "\n".join(lines + ["  nothing to check here", ""]), False
    on_gpu = torch.cuda.is_available()
    shapes = to_check(checks, on_gpu)
    where = "cuda (every listed M)" if on_gpu else f"cpu, at M={shapes[0].m} only (the CPU executor against float64)"
    try:
        result = run_preflight(shapes, "cuda" if on_gpu else "cpu")
    except PreflightError as e:
        return "\n".join(lines + [f"  checked here on {where}: FAILED", f"  {e}", ""]), True
    worst = "-" if result.worst_shape is None else result.worst_shape.describe()
    lines.append(f"  checked here on {where}: {result.shapes_checked} shapes passed on executor {result.executor!r}; "
                 f"worst error {result.worst_ratio:.3g} of the bound ({worst}); {result.seconds:.1f} s")
    return "\n".join(lines + [""]), False
