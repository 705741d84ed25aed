"""analysis.numerics_join: two numerics reports (the default reference, and an `analysis.reference`) joined from
their JSON files alone: the same effects block by block, each under its reference, with each source's sha256."""
from __future__ import annotations

import hashlib
import json

import pytest
from test_numerics import REFERENCE, correction_runs, numerics_runs

from analysis.config import AnalysisConfig
from analysis.numerics import make_numerics_report
from analysis.numerics_join import load_source, main
from analysis.synthetic import log_sweep


@pytest.fixture
def two_reports(sqlite_uri, tmp_path):
    log_sweep(sqlite_uri, "fp8rl", "linears", numerics_runs())
    log_sweep(sqlite_uri, "fp8rl", "corrections", correction_runs())
    a = make_numerics_report(sqlite_uri, "fp8rl", "linears", tmp_path / "a", log_artifacts=False,
                             config=AnalysisConfig(kind="numerics"))
    b = make_numerics_report(sqlite_uri, "fp8rl", "corrections", tmp_path / "b", log_artifacts=False,
                             config=AnalysisConfig(kind="numerics", reference=REFERENCE))
    return a, b


def test_join_keeps_each_reports_numbers(two_reports, tmp_path):
    a, b = two_reports
    out = tmp_path / "joined"
    assert main([f"linears={a.json}", str(b.json), "--out", str(out)]) == 0
    js = json.loads((out / "fig3_joined.json").read_text())
    assert [s["label"] for s in js["sources"]] == ["linears", "corrections"]  # LABEL=, else the sweep's name
    assert js["sources"][1]["reference"] == REFERENCE
    assert js["sources"][1]["sha256"] == hashlib.sha256(b.json.read_bytes()).hexdigest()
    for rep, src in zip((a, b), js["sources"]):
        assert src["order"] == [arm.label for arm in rep.result.compared]
        joined = load_source(str(rep.json)).result
        for got, want in zip(joined.compared, rep.result.compared):
            for key, e in want.effects.items():
                assert got.effects[key].differences == e.differences and got.effects[key].verdict == e.verdict
                assert (got.effects[key].ci_low, got.effects[key].ci_high) == (e.ci_low, e.ci_high)
    md = (out / "fig3_joined.md").read_text()
    assert "## linears: vs the default recipe" in md and "| effect (knob − default) |" in md
    assert "## corrections: vs the reference (fp8.format=nvfp4 + loss.importance_sampling=token)" in md
    assert "| loss.importance_sampling=icepop | mismatch excess ratio | 3 |" in md
    assert (out / "fig3_joined.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_join_refuses_reports_that_do_not_share_the_accuracy_metric(two_reports, tmp_path):
    a, b = two_reports
    js = json.loads(b.json.read_text())
    js["config"]["accuracy_metric"] = "val_accuracy_bf16_eval"
    b.json.write_text(json.dumps(js))
    with pytest.raises(SystemExit, match=r"config\.accuracy_metric is 'val_accuracy_bf16_eval', .* has "
                                         r"'val_accuracy'; joined rows must share it"):
        main([str(a.json), str(b.json), "--out", str(tmp_path / "j")])
    (tmp_path / "claims.json").write_text(json.dumps({"kind": "claims"}))
    with pytest.raises(SystemExit, match=r"claims\.json: kind is 'claims'; expected a numerics report"):
        load_source(str(tmp_path / "claims.json"))
