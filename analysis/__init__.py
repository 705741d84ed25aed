"""Analysis: MLflow -> aligned histories -> mean and 95% CI over seeds -> figures, table, claim checks.

    from analysis import make_report
    paths = make_report("sqlite:///mlflow.db", "fp8rl", "fp8_ablation", "outputs/report",
                        cell_ids=[c.id for c in expand(sweep)])   # only the file's current cells
    print(paths.verdicts_text)          # the claims table; json.dumps(paths.verdicts) for scripts

Modules, in the order data flows: `fetch` (histories out of MLflow; `cell_ids` leaves out runs of an
earlier version of the sweep file), `kernel_match` (`kernels_of(run)`: distinct, the study, or matched,
the zero-mismatch floor), `aggregate` (align steps, group by recipe × IS, Student-t CIs), `figures`
(Figures 1 and 2), `table` (summary Markdown/CSV), `summaries` (robust per-run summaries, tails,
paired cells), `floor` (the matched-kernel floor table), `eval_offset` (the step-0 offset
val_accuracy − val_accuracy_bf16_eval), `stats` (paired t, bootstrap, TOST, power, IQM, probability
of improvement), `config` (`AnalysisConfig`: margin, α, bootstrap, the deciding accuracy metric),
`claims` (PASS/FAIL/INCONCLUSIVE by paired tests), `episodes` (instability episodes per run under the
band `analysis.episodes`, their rate per arm), `episode_report` (the flagged runs, rates and the
sensitivity line: the claims without the flagged runs), `rleval` (IQM and P(X > Y) tables), `verdicts`
(the claims table for the terminal, JSON and Markdown), `report` (all of it, logged to the sweep's
parent run). `synthetic` makes sweeps with known effects for tests and demos. The studies beside the
claims (`analysis.kind`): `numerics` (+ `numerics_effects`, `numerics_table`, `numerics_figure`,
`numerics_arms`, `numerics_episodes`), each knob against the default recipe; `engines` (+ `engine_arms`),
Figure 1 per recipe · generation engine ("bf16 · vLLM"); `provenance` their JSON's provenance; `entry` is
their shared `python -m analysis.<study> SWEEP_FILE` entry point.
"""
from __future__ import annotations

from typing import Any


def make_report(*args: Any, **kwargs: Any):
    """See `analysis.report.make_report` (imported lazily: MLflow and matplotlib load on first use)."""
    from analysis.report import make_report as _make_report

    return _make_report(*args, **kwargs)
