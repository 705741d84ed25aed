"""Summary table: per-group numbers against an independent computation, Markdown and CSV content."""
from __future__ import annotations

import csv

import numpy as np
import pytest
from scipy import stats

from analysis.fetch import SweepData
from analysis.synthetic import synthetic_runs
from analysis.table import COLUMNS, markdown_table, summary_rows, write_table


@pytest.fixture(scope="module")
def data() -> SweepData:
    """With matched-kernel runs beside the distinct ones (left out of every row) and val_accuracy_bf16_eval."""
    return SweepData("u", "1", "t", None, synthetic_runs(seeds=3, steps=11, matched=("bf16", "fp8_gen"),
                                                         bf16_eval=True))


def _truth(data, recipe, isv):
    members = [r for r in data.runs if r.tags["recipe"] == recipe and r.tags["importance_sampling"] == isv
               and not r.tags["cell_id"].endswith("-matched")]
    final = np.array([r.metrics["val_accuracy"][1][-1] for r in members])
    final_bf16 = np.array([r.metrics["val_accuracy_bf16_eval"][1][-1] for r in members])
    mism = np.array([np.median(r.metrics["token_mult_prob_error"][1]) for r in members])  # median over steps
    half = lambda x: stats.t.ppf(0.975, len(x) - 1) * stats.sem(x)  # noqa: E731
    return {"final": final.mean(), "final_ci": half(final), "mm": mism.mean(), "mm_ci": half(mism),
            "bf16": final_bf16.mean(), "bf16_ci": half(final_bf16),
            "isw": np.mean([r.metrics["is_weight_mean"][1].mean() for r in members]),
            "st": np.mean([r.metrics["step_time_s"][1].mean() for r in members]),
            "tps": np.mean([r.metrics["tokens_per_s"][1].mean() for r in members])}


def test_rows_match_independent_numbers(data):
    rows = summary_rows(data)
    assert [(r["recipe"], r["importance_sampling"]) for r in rows] == [
        (rc, i) for rc in ("bf16", "fp8_gen", "fp8_e2e") for i in ("none", "token")]
    for row in rows:
        t = _truth(data, row["recipe"], row["importance_sampling"])
        assert row["seeds"] == 3
        assert row["final_val_accuracy"] == pytest.approx(t["final"], rel=1e-12)
        assert row["final_val_accuracy_ci95"] == pytest.approx(t["final_ci"], rel=1e-12)
        assert row["final_val_accuracy_bf16_eval"] == pytest.approx(t["bf16"], rel=1e-12)
        assert row["final_val_accuracy_bf16_eval_ci95"] == pytest.approx(t["bf16_ci"], rel=1e-12)
        assert row["mismatch"] == pytest.approx(t["mm"], rel=1e-12)
        assert row["mismatch_ci95"] == pytest.approx(t["mm_ci"], rel=1e-12)
        assert row["is_weight_mean"] == pytest.approx(t["isw"], rel=1e-12)
        assert row["step_time_s"] == pytest.approx(t["st"], rel=1e-12)
        assert row["tokens_per_s"] == pytest.approx(t["tps"], rel=1e-12)


def test_markdown_and_csv(data, tmp_path):
    md, cs = write_table(data, tmp_path)
    text = md.read_text()
    t = _truth(data, "fp8_gen", "token")
    assert "| recipe | importance_sampling | seeds | final val accuracy |" in text
    assert f"| fp8_gen | token | 3 | {t['final'] * 100:.1f} ± {t['final_ci'] * 100:.1f} % | " \
           f"{t['bf16'] * 100:.1f} ± {t['bf16_ci'] * 100:.1f} % | " \
           f"{t['mm']:.4f} ± {t['mm_ci']:.4f} | {t['isw']:.3f} | {t['st']:.2f} | {t['tps']:.0f} |" in text
    assert "95% CI" in text
    with open(cs) as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(COLUMNS) and len(rows) == 6
    row = next(r for r in rows if r["recipe"] == "fp8_gen" and r["importance_sampling"] == "token")
    assert float(row["final_val_accuracy"]) == pytest.approx(t["final"], rel=1e-5)
    assert float(row["mismatch_ci95"]) == pytest.approx(t["mm_ci"], rel=1e-5)


def test_missing_metrics_and_one_seed_leave_cells_empty():
    runs = synthetic_runs(recipes=("bf16",), is_variants=("none",), seeds=1, steps=3)
    del runs[0].metrics["tokens_per_s"]
    rows = summary_rows(SweepData("u", "1", "t", None, runs))
    assert np.isnan(rows[0]["tokens_per_s"]) and np.isnan(rows[0]["final_val_accuracy_ci95"])
    line = markdown_table(rows).splitlines()[2]
    cells = [c.strip() for c in line.split("|")[1:-1]]
    assert cells[8] == "–" and "±" not in cells[3]  # tokens/s; now followed by the episodes column
    assert cells[9].startswith("0/1 [0%, ")  # one run, no episode
    assert np.isnan(rows[0]["final_val_accuracy_bf16_eval"]) and line.split("|")[5].strip() == "–"  # an older run
