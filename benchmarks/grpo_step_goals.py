"""The goals benchmarks/grpo_step.py prints under its table: issue 16's (the FP8 rows against their FP32
floor, emulated BF16 within 1.15x of FP32) and issue 25's, for the CPU it runs on (fp8_e2e / bf16 <= 1.1, TRL /
ours >= 2.5 at the same precision where the CPU has BF16 dot products, reported elsewhere, each TRL ratio with
its bound). Pure functions of the timings (the dicts grpo_step.py collects) and the CPU's flags.
The goals are the tiny model's (`--model tiny`, the runs they were set on); for another model (`--model
smollm2`) the same ratios and bounds are printed, each marked reported with the tiny model's goal beside it,
never met / NOT met.
"""
from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

from fp8rl_core.fp8.cpu_features import kernel_flags
from fp8rl_core.fp8.gemm import select_executor
from fp8rl_core.model.bf16 import resolve_bf16_compute

BF16_PATHS = ("emulated", "native")  # `<recipe>-<path>`: the recipe in BF16 with model.bf16_compute=<path>
BF16_HARDWARE = ("avx512_bf16", "amx_bf16")  # BF16 dot products: where issue 25's goals apply
GOALS_MODEL = "tiny"  # the model the goals were set on


def goal(text: str, applies: bool) -> str:
    """`goal <= 1.25` where the goal applies (the tiny model), else that goal marked as the tiny model's."""
    return f"goal {text}" if applies else f"(reported; the {GOALS_MODEL} model's goal {text})"


def precision(name: str, dtype: str) -> str:
    """"bf16" or "fp32": what a row of ours computes its BF16 parts in (plain recipes: --dtype)."""
    recipe = name.removesuffix(" before").partition("@")[0]
    if recipe == "fp32":
        return "fp32"
    return "bf16" if recipe.rpartition("-")[2] in BF16_PATHS else dtype


def trl_partner(names: Iterable[str], prec: str, dtype: str) -> str | None:
    """The row of ours that TRL at `prec` is compared with: the plain bf16 / fp32 row at that precision."""
    names = list(names)
    return next((c for c in ("bf16", "fp32") if c in names and precision(c, dtype) == prec), None)


def _medians(results: dict[str, dict[str, Any]], key: str = "times") -> dict[str, float]:
    return {k: statistics.median(r[key]) for k, r in results.items()}


def issue16_lines(ours: dict[str, dict[str, Any]], dtype: str, flags: str, model: str = GOALS_MODEL) -> list[str]:
    """Issue 16's step goals, and the emulated-BF16 goal: ratio, goal, and the floor each ratio is taken
    against. With --dtype fp32 the bf16 recipe runs in plain FP32, so it is the fp32 floor. For a model other
    than the tiny one: the ratios, reported."""
    applies = model == GOALS_MODEL
    step, gen = _medians(ours), _medians(ours, "gen")
    if dtype == "fp32" and "bf16" in step and "fp32" not in step:
        step["fp32"], gen["fp32"] = step["bf16"], gen["bf16"]
    lines = ["goals (issue 16; emulated BF16):" if applies else
             f"ratios (issue 16; emulated BF16) with --model {model}: the goals are the {GOALS_MODEL} model's"]
    for k in (k for k in step if k.endswith("-emulated") and "fp32" in step):
        lines.append(f"{k + ' / ours fp32 step':<30}{step[k] / step['fp32']:6.2f}x   {goal('<= 1.15', applies)} "
                     f"(floor: fp32; CPU flags {flags})")
        lines.append(f"{k + ' / ours fp32 gen':<30}{gen[k] / gen['fp32']:6.2f}x   (reported)")
    for k in (k for k in step if k.startswith("fp8")):
        if "fp32" in step:
            lines.append(f"{k + ' / ours fp32 step':<30}{step[k] / step['fp32']:6.2f}x   {goal('<= 1.25', applies)} "
                         "(floor: fp32)")
            lines.append(f"{k + ' / ours fp32 gen':<30}{gen[k] / gen['fp32']:6.2f}x   {goal('<= 1.25', applies)} "
                         "(floor: fp32 gen)")
        if "bf16" in step and dtype == "fp32":  # with --dtype bf16: issue 25's lines
            lines.append(f"{k + ' / ours bf16 step':<30}{step[k] / step['bf16']:6.2f}x   (reported)")
    if "fp32" in step and "bf16" in step:
        lines.append(f"{'fp32 / ours bf16 step':<30}{step['fp32'] / step['bf16']:6.2f}x   (the FP32 floor vs BF16)")
    return lines


def bound_line(trl_r: dict[str, Any], ours_r: dict[str, Any], prec: str, hardware: bool) -> str:
    """The ceiling of TRL / ours: ours takes at least its GEMM time, so the ratio is at most TRL s / that."""
    g, tg = ours_r.get("gemm"), trl_r.get("gemm")
    if not g:
        return "    bound: - (no profiled step of ours)"
    trl_s, ours_s = statistics.median(trl_r["times"]), statistics.median(ours_r["times"])
    if prec == "fp32" or hardware:
        why = f"both sides run the same {'FP32' if prec == 'fp32' else 'native BF16'} GEMMs"
    else:
        why = ("not the same GEMMs: TRL's BF16 autocast runs torch's native BF16 GEMMs (slow without BF16 dot "
               "products), ours BF16 emulated on FP32 GEMMs")
    trl_gemm = f"TRL {tg:.3f} s GEMM + {trl_s - tg:.3f} s other" if tg is not None else "TRL GEMM -"
    return (f"    bound: TRL/ours <= {trl_s / g:.2f}x, TRL s/step over ours' floor, its GEMM s/step (ours {g:.3f} s "
            f"GEMM + {ours_s - g:.3f} s other; {trl_gemm}; {why})")


def issue25_lines(ours: dict[str, dict[str, Any]], trl: dict[str, dict[str, Any]], dtype: str, flags: str,
                  executor: str, model: str = GOALS_MODEL) -> list[str]:
    """Issue 25's goals on this CPU: fp8_e2e / bf16 <= 1.1 and TRL / ours >= 2.5 (same precision) where the
    CPU has BF16 dot products, reported elsewhere; fp8_gen / bf16 reported; each TRL ratio with its bound.
    For a model other than the tiny one: the same ratios and bounds, reported."""
    applies = model == GOALS_MODEL
    hw = [f for f in BF16_HARDWARE if f in flags.split()]
    path = resolve_bf16_compute("auto", "cpu", frozenset(flags.split()))
    where = f"BF16 dot products: {', '.join(hw)}" if hw else f"no BF16 dot products ({', '.join(BF16_HARDWARE)})"
    head = "goals (issue 25)" if applies else f"ratios (issue 25) with --model {model}"
    lines = [f"{head} on this CPU: kernel flags {flags}; FP8 GEMM executor {executor}; "
             f"model.bf16_compute auto -> {path}; {where}"]

    def verdict(ok: bool, goal: str) -> str:
        if not applies:
            return f"(reported; the {GOALS_MODEL} model's goal {goal})"
        if hw:
            return f"goal {goal} ({'met' if ok else 'NOT met'}; {', '.join(hw)})"
        return f"(reported; goal {goal} applies with {' or '.join(BF16_HARDWARE)})"

    step = _medians(ours)
    if dtype == "bf16" and "bf16" in step:
        for k in (k for k in ("fp8_e2e", "fp8_gen") if k in step):
            r = step[k] / step["bf16"]
            tail = verdict(r <= 1.1, "<= 1.1") if k == "fp8_e2e" else "(reported)"
            lines.append(f"{k + ' / ours bf16 step':<30}{r:6.2f}x   {tail}")
    for prec, t in trl.items():
        label, partner = f"TRL {prec} / ours {prec} step", trl_partner(step, prec, dtype)
        if partner is None:
            lines.append(f"{label:<30}{'-':>6}    (no row of ours in {prec.upper()}: recipes bf16 / fp32, --dtype)")
            continue
        ratio = statistics.median(t["times"]) / step[partner]
        lines.append(f"{label:<30}{ratio:6.2f}x   {verdict(ratio >= 2.5, '>= 2.5')} (ours: row {partner})")
        lines.append(bound_line(t, ours[partner], prec, bool(hw)))
    return lines


def goal_lines(ours: dict[str, dict[str, Any]], trl: dict[str, dict[str, Any]] | None, dtype: str = "bf16",
               flags: str | None = None, executor: str | None = None, model: str = GOALS_MODEL) -> list[str]:
    """Issue 16's and issue 25's goals; flags / executor default to this CPU's (kernel_flags, select_executor).
    model: --model; the goals apply to the tiny model only, any other gets its ratios reported."""
    flags = kernel_flags() if flags is None else flags
    executor = select_executor("cpu") if executor is None else executor
    return [*issue16_lines(ours, dtype, flags, model), *issue25_lines(ours, trl or {}, dtype, flags, executor, model)]


def print_goals(ours: dict[str, dict[str, Any]], trl: dict[str, dict[str, Any]] | None, dtype: str = "bf16",
                flags: str | None = None, executor: str | None = None, model: str = GOALS_MODEL) -> None:
    print("\n".join(goal_lines(ours, trl, dtype, flags, executor, model)))
