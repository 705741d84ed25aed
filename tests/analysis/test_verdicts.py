"""The verdicts where the user looks: the terminal table, the JSON form, the report's Markdown."""
from __future__ import annotations

import json

from analysis.claims import check_claims
from analysis.config import AnalysisConfig
from analysis.synthetic import constant_runs as runs_from
from analysis.verdicts import format_verdicts, verdicts_json, verdicts_markdown

CFG = AnalysisConfig(bootstrap_resamples=500)
SEED = [0.0, 0.03, -0.02, 0.01]
MM_OK = {"bf16": [1.004 + s for s in SEED],
         "fp8_gen": [1.06 + s + e for s, e in zip(SEED, (0.001, -0.0005, 0.0, 0.0008))],
         "fp8_e2e": [1.02 + s + e for s, e in zip(SEED, (-0.0002, 0.0003, 0.0001, 0.0))]}
ACC_OK = {("bf16", "none"): [0.70 + s for s in SEED], ("bf16", "token"): [0.701 + s for s in SEED],
          ("fp8_gen", "none"): [0.50 + s + e for s, e in zip(SEED, (0.0, 0.004, -0.003, 0.001))],
          ("fp8_gen", "token"): [0.66 + s for s in SEED], ("fp8_e2e", "token"): [0.698 + s for s in SEED]}


def test_terminal_table_has_verdict_effect_interval_n_and_power():
    noisy = {**ACC_OK, ("fp8_e2e", "token"): [0.70, 0.76, 0.66]}
    results = check_claims(runs_from({k: v[:3] for k, v in MM_OK.items()}, {k: v[:3] for k, v in noisy.items()}), CFG)
    text = format_verdicts(results, CFG)
    lines = text.splitlines()
    assert lines[0] == "Claims (4): 1 PASS; 2 PASS; 3 PASS; 4 INCONCLUSIVE"
    assert lines[2].split() == ["#", "verdict", "comparison", "effect", "interval", "bootstrap", "n"]
    row = next(line for line in lines if line.startswith("4  INCONCLUSIVE"))
    c = results[3].comparisons[0]
    assert f"{c.effect:+.1f} pts" in row and f"[{c.ci[0]:+.1f} pts, {c.ci[1]:+.1f} pts] (90%)" in row
    assert row.rstrip().endswith(" 3")
    power = lines[lines.index(row) + 1]
    assert power.strip().startswith("power: with 3 seeds the smallest detectable gap is ")
    assert "seeds would show" in power
    assert "-- claim 4: fp8_e2e + IS (token) matches bf16's final accuracy (TOST ±2 pts)" in text
    assert "within ±2 pts" in text and max(len(line) for line in lines[-4:]) <= 100


def test_json_round_trips_and_has_no_nan():
    results = check_claims(runs_from({k: v[:1] for k, v in MM_OK.items()}, ACC_OK), CFG)  # claims 1-2: 1 seed
    js = json.loads(json.dumps(verdicts_json(results, CFG), allow_nan=False))
    assert js["config"]["equivalence_margin"] == 2.0 and [c["status"] for c in js["claims"]][:2] == ["INCONCLUSIVE"] * 2
    comp = js["claims"][0]["comparisons"][0]
    assert comp["n"] == 1 and comp["ci"] == [None, None] and "at least 2" in comp["power_line"]
    assert js["claims"][3]["margin"] == 2.0 and js["claims"][3]["comparisons"][0]["ci_level"] == 0.9


def test_markdown_states_the_rule_and_margin():
    md = verdicts_markdown(check_claims(runs_from(MM_OK, ACC_OK), CFG), AnalysisConfig(equivalence_margin=3))
    assert md.count("**PASS**") == 5  # claim 1 has two comparisons
    assert "±3 pts" in md and "per-run median mismatch" in md and "- Claim 4:" in md


def test_the_other_accuracy_metric_and_claim_3s_second_half_are_shown_not_counted():
    from analysis.claims import other_accuracy_claims

    acc_eval = {**ACC_OK, ("fp8_e2e", "token"): [0.60 + s for s in SEED]}
    runs = runs_from(MM_OK, ACC_OK, acc_bf16_eval=acc_eval)
    results, aside = check_claims(runs, CFG), other_accuracy_claims(runs, CFG)
    text = format_verdicts(results, CFG, aside)
    lines = text.splitlines()
    assert lines[0] == "Claims (4): 1 PASS; 2 PASS; 3 PASS; 4 PASS"  # the deciding verdicts only
    heading = lines.index("== not deciding: claims 3–4 on val_accuracy_bf16_eval (analysis.accuracy_metric is "
                          "val_accuracy)")
    below = lines[heading:]
    assert any(line.startswith("4  (FAIL)") for line in below) and any(line.startswith("3  (PASS)") for line in below)
    left = [line for line in lines if "does not close it" in line]
    assert len(left) == 2 and all(line.startswith("3  (not closed)") for line in left)
    md = verdicts_markdown(results, CFG, aside)
    assert md.count("**PASS**") == 5 and "_(not closed)_" in md and "_(FAIL)_" in md
    assert "- Claim 4 on val_accuracy_bf16_eval (not deciding):" in md
    extra = {"stale_runs": 2, "floor": [{"median": float("nan")}]}
    js = json.loads(json.dumps(verdicts_json(results, CFG, aside, extra), allow_nan=False))
    assert [c["status"] for c in js["not_deciding"]] == ["PASS", "FAIL"] and js["stale_runs"] == 2
    assert js["floor"] == [{"median": None}] and js["claims"][2]["comparisons"][1]["decides"] is False
    assert js["claims"][2]["comparisons"][1]["finding"] == "not closed"
