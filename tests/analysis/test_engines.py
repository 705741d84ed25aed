"""analysis.engine_arms and analysis.engines: arms from the engine params (the engine and weight-only FP8 in
the label), per-run medians, ordering fractions, claims 1–2 against the real-kernel baseline, errors, files.

Synthetic runs with constant histories plus spikes the median ignores, so every per-run median and per-seed
difference is known exactly; intervals are checked against scipy. End to end through a real SQLite MLflow
store with `make_report` and `analysis.kind: engines`, and the two sweep files of the engine study.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from analysis.claims import FAIL, INCONCLUSIVE, PASS
from analysis.config import AnalysisConfig
from analysis.engine_arms import EngineArm, arm_from, expected_pairs
from analysis.engines import (
    FIG1,
    GEN_KL,
    MISMATCH,
    NOT_TESTED,
    EnginesReport,
    analyze,
    engines_figure,
    main,
)
from analysis.fetch import RunHistory
from analysis.kernel_match import KERNELS_PARAM, MATCHED
from analysis.links import ARTIFACT_DIR
from analysis.report import make_report
from analysis.synthetic import log_sweep
from fp8rl_core.diagnostics.catalogue import M_GEN_KL
from fp8rl_core.tracking import FINISHED, M_MISMATCH, TAG_CELL_ID, TAG_IS, TAG_RECIPE, TAG_SEED

REPO = Path(__file__).resolve().parents[2]
STEPS = np.arange(12, dtype=np.int64)
NATIVE_BF16, NATIVE_GEN, NATIVE_E2E, VLLM_BF16 = "bf16 · native", "fp8_gen · native", "fp8_e2e · native", "bf16 · vLLM"
W8A16_GEN, W8A16_E2E = "fp8_gen · vLLM W8A16", "fp8_e2e · vLLM W8A16"
PARAMS = {NATIVE_BF16: ("bf16", "native", False), NATIVE_GEN: ("fp8_gen", "native", False),
          NATIVE_E2E: ("fp8_e2e", "native", False), VLLM_BF16: ("bf16", "vllm", False),
          W8A16_GEN: ("fp8_gen", "vllm", True), W8A16_E2E: ("fp8_e2e", "vllm", True)}
# per arm, per seed 0-3: the median mismatch's excess (median − 1) and gen_kl. The vLLM arm lies between
# native bf16 and the FP8 arms in seeds 0-2 and above fp8_e2e in seed 3.
EXCESS = {NATIVE_BF16: [0.001, 0.0012, 0.0009, 0.0011], VLLM_BF16: [0.004, 0.005, 0.0045, 0.03],
          NATIVE_E2E: [0.010, 0.012, 0.011, 0.013], NATIVE_GEN: [0.020, 0.025, 0.022, 0.024]}
KL = {NATIVE_BF16: [1e-5, 2e-5, 1e-5, 2e-5], VLLM_BF16: [5e-5, 6e-5, 4e-5, 1e-3],
      NATIVE_E2E: [1e-4, 1e-4, 2e-4, 1e-4], NATIVE_GEN: [3e-4, 3e-4, 3e-4, 3e-4]}


def _run(label: str, seed: int, excess: float, kl: float, tags: dict | None = None, **params) -> RunHistory:
    recipe, generation, weight_only = PARAMS[label]
    mm = np.full(STEPS.size, 1.0 + excess)
    mm[[2, 9]] = 80.0  # spikes: the median does not see them
    gk = np.full(STEPS.size, kl)
    gk[5] = 3.0
    run_params = {TAG_RECIPE: recipe, "engines.generation": generation, "engines.training": "native",
                  "engines.vllm.fp8_weight_only": str(weight_only), KERNELS_PARAM: "distinct", **params}
    run_tags = {TAG_RECIPE: recipe, TAG_IS: "none", TAG_SEED: str(seed), TAG_CELL_ID: f"{label}-{seed}-{params}",
                **(tags or {})}
    return RunHistory(f"{label}/{seed}", f"{label}-s{seed}", FINISHED, run_tags, run_params,
                      {M_MISMATCH: (STEPS, mm), M_GEN_KL: (STEPS, gk)})


def study_runs(excess=EXCESS, kl=KL) -> list[RunHistory]:
    tags = {"fp8rl.vllm.version": "0.32.0", "fp8rl.vllm.device": "cpu", "fp8rl.vllm.fp8_kernel": "none"}
    return [_run(label, s, e, kl[label][s], tags if label == VLLM_BF16 else {"fp8rl.fp8_gemm": "emulated"})
            for label, per_seed in excess.items() for s, e in enumerate(per_seed)]


def test_labels_name_the_engine_and_weight_only_fp8():
    assert arm_from({"recipe": "bf16", "engines.generation": "vllm"}).label == VLLM_BF16
    assert arm_from({"recipe": "bf16"}).label == NATIVE_BF16  # runs logged before the engine keys existed
    assert arm_from({"engines.generation": "vllm", "engines.vllm.fp8_weight_only": "True"},
                    recipe="fp8_gen").label == W8A16_GEN
    # weight-only is never the seed's fp8_gen: the two labels differ, and vLLM FP8 without the knob is its own arm
    assert arm_from({"engines.generation": "vllm", "engines.vllm.fp8_weight_only": "False"},
                    recipe="fp8_gen").label == "fp8_gen · vLLM"
    assert arm_from({"engines.generation": "native", "engines.vllm.fp8_weight_only": "True"},
                    recipe="fp8_gen").label == NATIVE_GEN
    # bf16 quantizes nothing: the knob changes nothing, so no W8A16 in its label
    assert arm_from({"engines.generation": "vllm", "engines.vllm.fp8_weight_only": "true"},
                    recipe="bf16").label == VLLM_BF16
    assert arm_from({"recipe": "fp8_e2e", "engines.training": "megatron"}).label == "fp8_e2e · native → Megatron-Core"


def test_pairs_are_oriented_by_the_fixed_expected_order():
    arms = [arm_from({"recipe": r, "engines.generation": g, "engines.vllm.fp8_weight_only": str(w)})
            for r, g, w in PARAMS.values()]
    pairs = [(a.label, b.label) for a, b in expected_pairs(list(reversed(arms)))]
    assert pairs[:5] == [(NATIVE_BF16, VLLM_BF16), (NATIVE_BF16, NATIVE_E2E), (NATIVE_BF16, W8A16_E2E),
                         (NATIVE_BF16, NATIVE_GEN), (NATIVE_BF16, W8A16_GEN)]
    assert (VLLM_BF16, NATIVE_E2E) in pairs and (NATIVE_E2E, NATIVE_GEN) in pairs and (NATIVE_GEN, W8A16_GEN) in pairs
    assert len(pairs) == 15 and len(set(pairs)) == 15  # every unordered pair once


def test_medians_orderings_and_intervals():
    result = analyze(study_runs())
    assert [a.label for a in result.arms] == [NATIVE_BF16, VLLM_BF16, NATIVE_E2E, NATIVE_GEN]
    vllm = result.by_arm[VLLM_BF16]
    assert [vllm[s].values[MISMATCH] for s in "0123"] == pytest.approx([1.004, 1.005, 1.0045, 1.03])  # no spikes
    assert [vllm[s].values[GEN_KL] for s in "0123"] == pytest.approx(KL[VLLM_BF16])
    assert vllm["0"].tags["fp8rl.vllm.fp8_kernel"] == "none"
    o = {(x.low, x.high, x.metric): x for x in result.orderings}
    assert len(o) == 6 * 2
    v_e2e = o[(VLLM_BF16, NATIVE_E2E, MISMATCH)]
    assert (v_e2e.below, v_e2e.n, v_e2e.share) == (3, 4, 0.75)  # seed 3: vLLM above fp8_e2e
    d = np.array(EXCESS[NATIVE_E2E]) - np.array(EXCESS[VLLM_BF16])
    assert v_e2e.difference == pytest.approx(d.mean())
    lo, hi = stats.t.interval(0.95, d.size - 1, loc=d.mean(), scale=stats.sem(d))
    assert v_e2e.ci == (pytest.approx(lo), pytest.approx(hi))
    assert o[(NATIVE_BF16, VLLM_BF16, MISMATCH)].below == 4
    assert o[(VLLM_BF16, NATIVE_E2E, GEN_KL)].below == 3


def _claims(result) -> dict[str, object]:
    return {c.claim: c for c in result.claims}


def test_claim_1_against_the_real_baseline_passes_fails_and_stays_inconclusive():
    claims = _claims(analyze(study_runs()))
    real = next(c for k, c in claims.items() if k.startswith("bf16 with real inference kernels"))
    # seed 3's vLLM run lies above fp8_e2e: fp8_e2e − vLLM has an interval holding 0
    assert real.status == INCONCLUSIVE
    assert [c.name for c in real.comparisons] == [f"{NATIVE_E2E} − {VLLM_BF16}", f"{NATIVE_GEN} − {VLLM_BF16}"]
    ours = next(c for k, c in claims.items() if k.startswith("bf16 between our own engines"))
    assert ours.status == PASS
    c2 = next(c for k, c in claims.items() if k.startswith("fp8_e2e has a lower mismatch than fp8_gen, our own"))
    assert c2.status == PASS and c2.comparisons[0].n == 4
    # no FP8 arm with vLLM generation: claim 2 with real kernels is not tested, and the reason names AMX
    c2_real = next(c for k, c in claims.items() if k.endswith("real inference kernels"))
    assert c2_real.status == NOT_TESTED and "amx_tile" in c2_real.evidence and "W8A16" in c2_real.evidence

    above = {**EXCESS, VLLM_BF16: [0.05, 0.06, 0.055, 0.058]}  # vLLM BF16 above every native FP8 arm in every seed
    real = next(c for c in analyze(study_runs(above)).claims if c.claim.startswith("bf16 with real"))
    assert real.status == FAIL
    below = {**EXCESS, VLLM_BF16: [0.004, 0.005, 0.0045, 0.006]}
    assert next(c for c in analyze(study_runs(below)).claims if c.claim.startswith("bf16 with real")).status == PASS


def test_weight_only_arms_pair_with_each_other_never_with_the_seeds_recipe():
    excess = {**EXCESS, W8A16_GEN: [0.008, 0.009, 0.0085, 0.0095]}
    result = analyze(study_runs(excess, {**KL, W8A16_GEN: [1e-4] * 4}))
    assert [a.label for a in result.arms][-1] == W8A16_GEN
    assert result.by_arm[NATIVE_GEN]["0"].values[MISMATCH] == pytest.approx(1.02)  # not overwritten by W8A16
    claims = _claims(result)
    real = next(c for k, c in claims.items() if k.startswith("bf16 with real"))
    assert f"{W8A16_GEN} − {VLLM_BF16}" in [c.name for c in real.comparisons]
    w8 = [c for k, c in claims.items() if "real inference kernels" in k and k.startswith("fp8_e2e")]
    assert len(w8) == 1 and w8[0].status == NOT_TESTED and w8[0].evidence == f"only {W8A16_GEN} ran"
    both = analyze(study_runs({**excess, W8A16_E2E: [0.005, 0.006, 0.0055, 0.0065]},
                              {**KL, W8A16_GEN: [1e-4] * 4, W8A16_E2E: [1e-4] * 4}))
    w8 = next(c for c in both.claims if c.claim.startswith("fp8_e2e") and W8A16_GEN in c.claim)
    assert w8.status == PASS and w8.comparisons[0].name == f"{W8A16_GEN} − {W8A16_E2E}"


def test_two_runs_of_one_arm_and_seed_are_refused_with_the_differing_param():
    runs = study_runs()
    runs.append(_run(VLLM_BF16, 0, 0.004, 1e-5, **{"engines.vllm.max_num_seqs": "64"}))
    with pytest.raises(ValueError, match=r"bf16 · vLLM.*seed 0.*engines\.vllm\.max_num_seqs"):
        analyze(runs)


def test_matched_kernel_runs_are_left_out():
    runs = study_runs() + [_run(NATIVE_BF16, 0, 0.0, 0.0, **{KERNELS_PARAM: MATCHED})]
    result = analyze(runs)
    assert len(result.runs) == 16 and result.by_arm[NATIVE_BF16]["0"].values[MISMATCH] == pytest.approx(1.001)


def test_figure_has_one_curve_per_arm_labelled_with_the_engine():
    runs = study_runs()
    fig = engines_figure(analyze(runs), runs, "synthetic")
    labels = [line.get_label() for line in fig.axes[0].get_lines() if not line.get_label().startswith("_")]
    assert labels == [NATIVE_BF16, VLLM_BF16, NATIVE_E2E, NATIVE_GEN]
    styles = {line.get_label(): line.get_linestyle() for line in fig.axes[0].get_lines()}
    assert styles[VLLM_BF16] == "--" and styles[NATIVE_BF16] == "-"


def test_make_report_with_kind_engines_writes_and_logs_the_files(sqlite_uri, tmp_path):
    runs = study_runs()
    parent = log_sweep(sqlite_uri, "fp8rl", "engines", runs)
    rep = make_report(sqlite_uri, "fp8rl", "engines", tmp_path / "out", parent_run_id=parent,
                      config=AnalysisConfig(kind="engines"))
    assert isinstance(rep, EnginesReport) and rep.logged_to == parent
    assert {p.name for p in rep.files()} == {"report.md", f"{FIG1}.png", f"{FIG1}.svg", "engines.md", "engines.json"}
    assert all(p.is_file() and p.stat().st_size > 0 for p in rep.files())
    js = json.loads(rep.json.read_text())
    assert js["engine_tags"][VLLM_BF16]["fp8rl.vllm.version"] == ["0.32.0"]
    assert js["engine_tags"][NATIVE_E2E]["fp8rl.fp8_gemm"] == ["emulated"]
    assert [a["arm"] for a in js["arms"]] == [NATIVE_BF16, VLLM_BF16, NATIVE_E2E, NATIVE_GEN]
    text = rep.report.read_text()
    assert f"| {VLLM_BF16} | {NATIVE_E2E} | token_mult_prob_error | 3/4 |" in text
    assert "bf16 · vLLM: 4 runs" in rep.verdicts_text
    from mlflow import MlflowClient

    logged = {f.path for f in MlflowClient(sqlite_uri).list_artifacts(parent, ARTIFACT_DIR)}
    assert f"report/{FIG1}.png" in logged and "report/engines.json" in logged


def test_the_sweep_files_declare_the_arms_they_say(tmp_path):
    from launchers.plan.grid import expand_grid
    from launchers.sweepfile.loading import load_sweep

    cpu = load_sweep(REPO / "sweeps" / "fp8_vllm_cpu.yaml", cwd=tmp_path)
    amx = load_sweep(REPO / "sweeps" / "fp8_vllm_amx.yaml", cwd=tmp_path)
    assert AnalysisConfig.from_dict(cpu.spec.analysis).kind == "engines"

    def arms(sweep) -> dict[str, EngineArm]:
        cells = expand_grid(sweep).cells
        out = {}
        for c in cells:
            cfg = c.config
            assert cfg.loss.importance_sampling == "none"
            arm = arm_from({"engines.generation": cfg.engines.generation,
                            "engines.vllm.fp8_weight_only": str(cfg.engines.vllm.fp8_weight_only)}, cfg.recipe)
            out.setdefault(arm.label, []).append((c.id, cfg.seed, cfg.fp8.gemm))
        return out

    a_cpu, a_amx = arms(cpu), arms(amx)
    assert list(a_cpu) == [NATIVE_BF16, NATIVE_GEN, NATIVE_E2E, VLLM_BF16]
    assert list(a_amx) == [*a_cpu, W8A16_GEN]
    assert all(len(v) >= 3 for v in a_cpu.values())  # >= 3 seeds per arm, the same seeds in every arm
    assert len({tuple(s for _, s, _ in v) for v in a_cpu.values()}) == 1
    assert {g for v in a_cpu.values() for _, _, g in v} == {"emulated"}  # the executor is pinned in every arm
    for label in a_cpu:  # the AMX file's shared arms are the same cells (same ids): the W8A16 arm pairs with them
        assert a_amx[label] == a_cpu[label]


def test_main_reads_the_sweep_file(sqlite_uri, tmp_path, capsys):
    assert main([str(REPO / "sweeps" / "fp8_vllm_cpu.yaml"), "--tracking-uri", sqlite_uri, "--no-log",
                 "--out", str(tmp_path)]) == 1
    assert "no runs of sweep 'fp8_vllm_cpu'" in capsys.readouterr().err
