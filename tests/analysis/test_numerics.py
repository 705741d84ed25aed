"""analysis.numerics: arms from the knob params, paired effects and intervals, ordering, errors, files.

The synthetic runs have constant histories (plus two mismatch spikes the median ignores), so every
per-run summary and per-seed difference is known exactly; the intervals are checked against an
independent scipy computation. End to end through a real SQLite MLflow store, `make_report` with
`analysis.kind: numerics`, and the `python -m analysis.numerics SWEEP_FILE` entry point.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from mlflow import MlflowClient
from scipy import stats

from analysis.config import AnalysisConfig, EpisodeBand
from analysis.fetch import RunHistory
from analysis.kernel_match import KERNELS_PARAM, MATCHED
from analysis.links import ARTIFACT_DIR
from analysis.numerics import FIG3, MISMATCH_LOG, NumericsReport, analyze, main, make_numerics_report
from analysis.numerics_arms import (
    DEFAULT_ARM,
    HIGHER,
    LOWER,
    NONE,
    TOO_FEW,
    _default_scale_format,
    arm_label,
    knob_values,
)
from analysis.numerics_table import markdown_table
from analysis.report import make_report
from analysis.synthetic import log_sweep
from fp8rl_core.diagnostics.catalogue import M_GEN_KL
from fp8rl_core.tracking import (
    FINISHED,
    M_MISMATCH,
    M_VAL_ACC,
    M_VAL_ACC_BF16_EVAL,
    TAG_CELL_ID,
    TAG_IS,
    TAG_RECIPE,
    TAG_SEED,
    TAIL_FRACTIONS,
)

SEEDS = 3
STEPS = np.arange(10, dtype=np.int64)
VAL_STEPS = np.array([0, 5, 9], dtype=np.int64)
BASE_EXCESS = [0.010, 0.012, 0.009]  # default arm: median mismatch − 1 per seed
BASE_KL = [1e-4, 1.2e-4, 0.9e-4]
BASE_ACC = [0.60, 0.64, 0.62]
# arm params -> per seed (excess ratio, gen_kl difference, final-accuracy difference)
ARMS = {
    "fp8.format=nvfp4": ({"fp8.format": "nvfp4"}, [(5.0, 4e-4, -0.05), (6.0, 5e-4, -0.03), (4.0, 4.5e-4, -0.04)]),
    "fp8.quantize_from=master": ({"fp8.quantize_from": "master"},
                                 [(2.0, 1e-4, 0.01), (2.5, 0.5e-4, -0.01), (1.5, 1.5e-4, 0.0)]),
    # the legacy key: power_of_two_scales true is scale_format pow2; an effect that straddles 1
    "fp8.scale_format=pow2": ({"fp8.power_of_two_scales": "True"}, [(1.2, 0.0, 0.0), (0.9, 0.0, 0.01), (1.05, 0, 0)]),
    "fp8.bf16_last_layers=2": ({"fp8.bf16_last_layers": "2"},
                               [(0.5, -2e-5, 0.01), (0.6, -3e-5, 0.02), (0.55, -2.5e-5, 0.015)]),
    # two knobs in one cell: its own arm, labelled with both
    "fp8.lm_head=fp8 + fp8.bf16_first_layers=1": ({"fp8.lm_head": "fp8", "fp8.bf16_first_layers": "1"},
                                                  [(3.0, 2e-4, 0.0), (3.5, 2e-4, 0.0), (2.8, 2e-4, 0.0)]),
}
DEFAULT_PARAMS = {"recipe": "fp8_e2e", "fp8.format": "block128", "fp8.scale_format": "auto",
                  "fp8.quantize_from": "bf16", "fp8.lm_head": "bf16", "fp8.bf16_first_layers": "0",
                  "fp8.bf16_last_layers": "0", "fp8.power_of_two_scales": "False", KERNELS_PARAM: "distinct"}


def _run(name: str, seed: int, params: dict, excess: float, kl: float, acc: float) -> RunHistory:
    mm = np.full(STEPS.size, 1.0 + excess)
    mm[[3, 7]] = 50.0  # spikes: the median does not see them
    metrics = {M_MISMATCH: (STEPS, mm), M_GEN_KL: (STEPS, np.full(STEPS.size, kl)),
               M_VAL_ACC: (VAL_STEPS, np.array([0.3, 0.4, acc])),
               M_VAL_ACC_BF16_EVAL: (VAL_STEPS, np.array([0.3, 0.4, acc - 0.01]))}
    for i, key in enumerate(TAIL_FRACTIONS):
        metrics[key] = (STEPS, np.full(STEPS.size, excess * 10.0 ** -i))
    tags = {TAG_RECIPE: params.get("recipe", "fp8_e2e"), TAG_IS: "none", TAG_SEED: str(seed),
            TAG_CELL_ID: f"{name}-{seed}"}
    return RunHistory("", f"{name}-s{seed}", FINISHED, tags, {**DEFAULT_PARAMS, **params}, metrics)


def numerics_runs(arms=ARMS, default: bool = True) -> list[RunHistory]:
    runs = [_run("default", s, {}, BASE_EXCESS[s], BASE_KL[s], BASE_ACC[s]) for s in range(SEEDS)] if default else []
    for i, (params, per_seed) in enumerate(arms.values()):
        for s, (ratio, dkl, dacc) in enumerate(per_seed):
            runs.append(_run(f"arm{i}", s, params, BASE_EXCESS[s] * ratio, BASE_KL[s] + dkl, BASE_ACC[s] + dacc))
    return runs


def _scipy_interval(d: np.ndarray, confidence: float = 0.95) -> tuple[float, float]:
    return stats.t.interval(confidence, d.size - 1, loc=d.mean(), scale=stats.sem(d))


def _expected(label: str) -> dict[str, np.ndarray]:
    per_seed = ARMS[label][1]
    ratio = np.array([r for r, _, _ in per_seed])
    return {MISMATCH_LOG: np.log10(ratio),
            "mismatch_median": np.array(BASE_EXCESS) * (ratio - 1),
            M_GEN_KL: np.array([k for _, k, _ in per_seed]),
            f"final_{M_VAL_ACC}": np.array([a for _, _, a in per_seed]),
            TAIL_FRACTIONS[0]: np.array(BASE_EXCESS) * (ratio - 1)}


def test_arm_labels_normalize_the_knobs():
    assert arm_label(DEFAULT_PARAMS) == DEFAULT_ARM
    assert arm_label({}) == DEFAULT_ARM  # runs logged before the keys existed
    assert arm_label({"fp8.format": "mxfp8"}) == "fp8.format=mxfp8"
    assert arm_label({"fp8.power_of_two_scales": "True"}) == "fp8.scale_format=pow2"
    assert arm_label({"fp8.scale_format": "pow2", "fp8.power_of_two_scales": "False"}) == "fp8.scale_format=pow2"
    assert arm_label({"fp8.bf16_first_layers": "0", "fp8.bf16_last_layers": "3"}) == "fp8.bf16_last_layers=3"
    assert arm_label({"fp8.lm_head": "fp8", "fp8.format": "tensorwise"}) == "fp8.format=tensorwise + fp8.lm_head=fp8"
    assert knob_values({})["fp8.scale_format"] == "auto"
    if _default_scale_format("block128") == "fp32":  # the core's format table: fp32 is block128's own default
        assert arm_label({"fp8.format": "block128", "fp8.scale_format": "fp32"}) == DEFAULT_ARM
        assert arm_label({"fp8.format": "mxfp8", "fp8.scale_format": _default_scale_format("mxfp8")}) == \
            "fp8.format=mxfp8"


def test_kv_cache_and_correction_knobs_label_their_arms():
    """The FP8 KV cache's knobs and the mismatch correction are knobs too (sweeps/fp8_kv_cache.yaml,
    sweeps/fp8_corrections.yaml): an arm differing in them is labelled and compared, at their defaults it is not."""
    kv = {"fp8.kv_cache": "e4m3", "fp8.kv_scale": "first_forward"}
    assert arm_label(kv) == "fp8.kv_cache=e4m3 + fp8.kv_scale=first_forward"
    assert arm_label({"fp8.kv_cache": "e4m3"}) == "fp8.kv_cache=e4m3"  # trainer scales, from BF16: the defaults
    assert arm_label({"fp8.kv_cache": "e4m3", "fp8.kv_scale": "per_token_head", "fp8.kv_quantize_from": "bf16"}) \
        == "fp8.kv_cache=e4m3 + fp8.kv_scale=per_token_head"
    assert arm_label({"fp8.kv_cache": "auto", "fp8.kv_scale": "trainer", "fp8.kv_quantize_from": "bf16",
                      "loss.importance_sampling": "none"}) == DEFAULT_ARM
    assert arm_label({"loss.importance_sampling": "icepop"}) == "loss.importance_sampling=icepop"
    assert list(knob_values({}))[-4:] == ["fp8.kv_cache", "fp8.kv_scale", "fp8.kv_quantize_from",
                                          "loss.importance_sampling"]


def test_effects_intervals_and_verdicts_match_scipy():
    result = analyze(numerics_runs())
    arms = {a.label: a for a in result.arms}
    assert set(arms) == {DEFAULT_ARM, *ARMS}
    assert arms[DEFAULT_ARM].effects == {} and sorted(arms[DEFAULT_ARM].runs) == ["0", "1", "2"]
    for label in ARMS:
        for key, d in _expected(label).items():
            e = arms[label].effects[key]
            assert e.n == SEEDS and e.seeds == ["0", "1", "2"]
            np.testing.assert_allclose(e.differences, d, rtol=1e-9, atol=1e-15)
            assert e.mean == pytest.approx(d.mean(), rel=1e-9, abs=1e-15)
            if np.ptp(d) > 1e-12:
                lo, hi = _scipy_interval(d)
                assert (e.ci_low, e.ci_high) == (pytest.approx(lo, rel=1e-6, abs=1e-15),
                                                 pytest.approx(hi, rel=1e-6, abs=1e-15))
                assert e.p_value == pytest.approx(stats.ttest_1samp(d, 0.0).pvalue, rel=1e-6)
    nv = arms["fp8.format=nvfp4"].effects
    assert nv[MISMATCH_LOG].verdict == HIGHER and nv[M_GEN_KL].verdict == HIGHER
    assert nv[f"final_{M_VAL_ACC}"].verdict == LOWER
    assert arms["fp8.bf16_last_layers=2"].effects[MISMATCH_LOG].verdict == LOWER
    assert arms["fp8.scale_format=pow2"].effects[MISMATCH_LOG].verdict == NONE
    assert arms["fp8.quantize_from=master"].effects[f"final_{M_VAL_ACC}"].verdict == NONE
    assert arms["fp8.lm_head=fp8 + fp8.bf16_first_layers=1"].n_knobs == 2


def test_ordered_by_mismatch_effect():
    result = analyze(numerics_runs())
    assert result.arms[0].label == DEFAULT_ARM
    means = {label: np.log10([r for r, _, _ in per_seed]).mean() for label, (_, per_seed) in ARMS.items()}
    assert [a.label for a in result.compared] == sorted(means, key=lambda k: -means[k])
    assert result.compared[0].label == "fp8.format=nvfp4" and result.compared[-1].label == "fp8.bf16_last_layers=2"


def test_accuracy_metric_of_the_config_and_missing_seeds():
    cfg = AnalysisConfig(accuracy_metric=M_VAL_ACC_BF16_EVAL, alpha=0.1)
    runs = [r for r in numerics_runs() if not (r.run_name.startswith("arm0") and r.tags[TAG_SEED] == "2")]
    result = analyze(runs, cfg)
    assert result.confidence == pytest.approx(0.9)
    assert [m.key for m in result.metrics][-2:] == [f"final_{M_VAL_ACC_BF16_EVAL}", f"final_{M_VAL_ACC}"]
    e = next(a for a in result.arms if a.label == "fp8.format=nvfp4").effects[f"final_{M_VAL_ACC_BF16_EVAL}"]
    d = np.array([-0.05, -0.03])  # seed 2 of the arm is missing: two pairs
    assert e.seeds == ["0", "1"] and e.n == 2
    lo, hi = _scipy_interval(d, 0.9)
    assert (e.ci_low, e.ci_high) == (pytest.approx(lo), pytest.approx(hi))
    one = analyze([r for r in runs if not (r.run_name.startswith("arm0") and r.tags[TAG_SEED] == "1")], cfg)
    e1 = next(a for a in one.arms if a.label == "fp8.format=nvfp4").effects[MISMATCH_LOG]
    assert e1.n == 1 and e1.verdict == TOO_FEW and math.isnan(e1.ci_low)


def test_missing_default_arm_is_a_clear_error():
    with pytest.raises(ValueError, match=r"no default arm: no run has every numerics knob at its default "
                                         r"\(fp8\.format=block128, .*arms found: fp8\.bf16_last_layers=2, "):
        analyze(numerics_runs(default=False))


def test_two_runs_of_one_arm_and_seed_name_what_differs():
    runs = numerics_runs()
    runs.append(_run("bf16", 0, {"recipe": "bf16"}, 0.001, 1e-5, 0.6))  # all knobs default: a second default
    with pytest.raises(ValueError, match=r"arm 'default', seed 0: 2 runs .* they differ in recipe\. "):
        analyze(runs)
    matched = _run("matched", 0, {KERNELS_PARAM: MATCHED}, 0.0, 0.0, 0.6)  # the floor: left out, no collision
    assert len(analyze([*numerics_runs(), matched]).runs) == len(numerics_runs())


def test_report_through_mlflow_writes_figure_table_json(sqlite_uri, tmp_path):
    runs = numerics_runs()
    parent = log_sweep(sqlite_uri, "fp8rl", "numerics", runs)
    rep = make_numerics_report(sqlite_uri, "fp8rl", "numerics", tmp_path / "out", sweep_file=None)
    assert isinstance(rep, NumericsReport) and rep.logged_to == parent
    assert sorted(p.name for p in rep.files()) == sorted(["report.md", f"{FIG3}.png", f"{FIG3}.svg", "numerics.md",
                                                          "numerics.json"])
    assert all(p.exists() and p.stat().st_size > 100 for p in rep.files())
    assert rep.figure[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    logged = {f.path for f in MlflowClient(sqlite_uri).list_artifacts(parent, ARTIFACT_DIR)}
    assert logged == {f"{ARTIFACT_DIR}/{p.name}" for p in rep.files()}
    # the params came back from MLflow's one search: the same arms and numbers as in memory
    truth = analyze(runs)
    assert [a.label for a in rep.result.arms] == [a.label for a in truth.arms]
    for got, want in zip(rep.result.compared, truth.compared):
        for key, e in want.effects.items():
            np.testing.assert_allclose(got.effects[key].differences, e.differences, rtol=1e-12)
    js = json.loads(rep.json.read_text())
    assert js == json.loads(json.dumps(rep.verdicts))
    assert js["provenance"]["experiment"] == "fp8rl" and js["provenance"]["parent_run_id"] == parent
    assert js["provenance"]["date"] and "git_commit" in js["provenance"]
    arm = next(a for a in js["arms"] if a["arm"] == "fp8.format=nvfp4")
    ids = {r.tags[TAG_SEED]: r.run_id for r in runs if r.run_name.startswith("arm0")}
    assert arm["run_ids"] == ids
    assert arm["effects"][MISMATCH_LOG]["ratio"] == pytest.approx((5.0 * 6.0 * 4.0) ** (1 / 3))  # geometric mean
    assert js["order"] == [a.label for a in truth.compared]
    table = rep.table_md.read_text()
    assert "| fp8.format=nvfp4 | mismatch excess ratio | 3 | ×4.93 | " in table and "| higher |" in table
    assert "| fp8.lm_head=fp8 + fp8.bf16_first_layers=1 (2 knobs) |" in table
    assert "no detectable difference" in table
    assert "](fig3_numerics.png)" in rep.report.read_text()
    assert rep.verdicts_text.startswith("Numerics (paired by seed vs default, 95% t intervals):")


def test_make_report_hands_over_for_kind_numerics(sqlite_uri, tmp_path):
    log_sweep(sqlite_uri, "fp8rl", "numerics", numerics_runs())
    rep = make_report(sqlite_uri, "fp8rl", "numerics", tmp_path, config=AnalysisConfig.from_dict({"kind": "numerics"}),
                      log_artifacts=False)
    assert isinstance(rep, NumericsReport) and rep.logged_to is None
    assert rep.report.name == "report.md" and rep.report.read_text().startswith("# Numerics report: numerics")
    assert not (tmp_path / "claims.md").exists()


def test_config_kind():
    assert AnalysisConfig().kind == "claims" and "kind" not in AnalysisConfig().to_dict()  # claims.json unchanged
    numerics = AnalysisConfig.from_dict({"kind": "numerics"})
    assert numerics.to_dict()["kind"] == "numerics" and AnalysisConfig.from_dict(numerics.to_dict()) == numerics
    with pytest.raises(ValueError,
                       match=r"analysis\.kind: 'numeric' is invalid; expected one of: claims, numerics, engines"):
        AnalysisConfig.from_dict({"kind": "numeric"})
    with pytest.raises(ValueError, match=r"analysis\.kind: expected one of: claims, numerics, engines; got 3"):
        AnalysisConfig.from_dict({"kind": 3})


SWEEP = """\
experiment: numerics_cli
base:
  model: {{preset: tiny}}
  recipe: fp8_e2e
zip:
  - fp8.quantize_from: [bf16, master, bf16]
    fp8.bf16_last_layers: [0, 0, 2]
seeds: 3
analysis: {{kind: numerics}}
tracking:
  uri: {uri}
"""


def test_cli_reads_the_sweep_file(sqlite_uri, tmp_path, capsys):
    from fp8rl_core.tracking.sink import run_params
    from fp8rl_core.tracking.store import flatten_params
    from launchers.plan.cells import cell_tags
    from launchers.plan.grid import expand_grid
    from launchers.sweepfile.loading import load_sweep

    path = tmp_path / "numerics.yaml"
    path.write_text(SWEEP.format(uri=sqlite_uri))
    sweep = load_sweep(path)
    runs = []
    for cell in expand_grid(sweep).cells:
        seed, params = cell.config.seed, flatten_params(run_params(cell.config))
        label = arm_label(params)
        effect = {DEFAULT_ARM: 1.0, "fp8.quantize_from=master": 2.0, "fp8.bf16_last_layers=2": 0.5}[label]
        ratio = effect * (1 + seed / 10)
        run = _run(label, seed, {}, BASE_EXCESS[seed] * ratio, BASE_KL[seed], BASE_ACC[seed])
        run.tags, run.params = cell_tags(sweep, cell), params
        runs.append(run)
    assert sorted({arm_label(r.params) for r in runs}) == [DEFAULT_ARM, "fp8.bf16_last_layers=2",
                                                          "fp8.quantize_from=master"]
    log_sweep(sqlite_uri, sweep.experiment, sweep.experiment, runs)
    out = tmp_path / "out"
    assert main([str(path), "--out", str(out), "--tracking-uri", sqlite_uri, "--no-log"]) == 0
    printed = capsys.readouterr().out
    assert "fp8.quantize_from=master (n=3): mismatch excess ratio ×" in printed
    js = json.loads((out / "numerics.json").read_text())
    assert js["provenance"]["sweep_file"] == str(path) and len(js["provenance"]["sweep_file_sha256"]) == 64
    assert js["order"] == ["fp8.quantize_from=master", "fp8.bf16_last_layers=2"]
    assert (out / f"{FIG3}.png").exists()
    assert main([str(path), "--out", str(out), "--tracking-uri", f"sqlite:///{tmp_path / 'empty.db'}"]) == 1


def test_sweep_file_kind_is_validated(tmp_path):
    from launchers.sweepfile.loading import load_sweep

    path = tmp_path / "bad.yaml"
    path.write_text(SWEEP.format(uri="sqlite:///mlflow.db").replace("kind: numerics", "kind: numeric"))
    with pytest.raises(Exception, match=r"analysis\.kind.*'numeric' is invalid; expected one of: claims, numerics"):
        load_sweep(path)
    path.write_text(SWEEP.format(uri="sqlite:///mlflow.db"))
    assert AnalysisConfig.from_dict(load_sweep(path).spec.analysis).kind == "numerics"


# --- analysis.reference: every arm paired with a named arm (sweeps/fp8_corrections.yaml) ----------------------
NVFP4 = {"fp8.format": "nvfp4"}
# importance_sampling -> per seed (excess ratio vs token, gen_kl difference, final-accuracy difference vs token)
CORRECTIONS = {"none": [(1.5, 2e-4, -0.02), (1.4, 1e-4, -0.03), (1.6, 3e-4, -0.01)],
               "icepop": [(0.9, -1e-5, 0.04), (0.8, -2e-5, 0.05), (1.0, 0.0, 0.03)]}
REFERENCE = {"fp8.format": "nvfp4", "loss.importance_sampling": "token"}


def correction_runs(token: bool = True) -> list[RunHistory]:
    """NVFP4 generation in every run: the token-IS arm has BASE_* values, the others differ by CORRECTIONS."""
    token_runs = [_run("token", s, {**NVFP4, "loss.importance_sampling": "token"}, BASE_EXCESS[s], BASE_KL[s],
                       BASE_ACC[s]) for s in range(SEEDS)] if token else []
    return token_runs + [
        _run(v, s, {**NVFP4, "loss.importance_sampling": v}, BASE_EXCESS[s] * r, BASE_KL[s] + dkl, BASE_ACC[s] + dacc)
        for v, per_seed in CORRECTIONS.items() for s, (r, dkl, dacc) in enumerate(per_seed)]


def test_reference_config_is_validated_at_the_edge():
    cfg = AnalysisConfig.from_dict({"kind": "numerics", "reference": {"fp8.format": "nvfp4",
                                                                       "fp8.bf16_last_layers": 1}})
    assert cfg.reference == {"fp8.format": "nvfp4", "fp8.bf16_last_layers": "1"}  # strings, as params hold them
    assert AnalysisConfig.from_dict(cfg.to_dict()) == cfg and "reference" not in AnalysisConfig().to_dict()
    with pytest.raises(ValueError, match=r"analysis\.reference\.fp8\.formats: not a numerics knob; valid knobs are: "
                                         r"fp8\.format, .*loss\.importance_sampling"):
        AnalysisConfig.from_dict({"kind": "numerics", "reference": {"fp8.formats": "nvfp4"}})
    with pytest.raises(ValueError, match=r"analysis\.reference: expected a mapping of numerics knobs"):
        AnalysisConfig.from_dict({"kind": "numerics", "reference": "token"})
    with pytest.raises(ValueError, match=r"analysis\.reference\.fp8\.format: expected one value"):
        AnalysisConfig.from_dict({"kind": "numerics", "reference": {"fp8.format": ["nvfp4"]}})
    with pytest.raises(ValueError, match=r"analysis\.reference: .* is invalid; expected unset: only a numerics report"):
        AnalysisConfig.from_dict({"reference": {"fp8.format": "nvfp4"}})  # the claims report has no reference


def test_arms_pair_with_the_reference_arm():
    cfg = AnalysisConfig(kind="numerics", reference=REFERENCE)
    result = analyze(correction_runs(), cfg)
    assert result.base == "reference" and result.arms[0].label == "reference"
    assert result.base_text == "the reference (fp8.format=nvfp4 + loss.importance_sampling=token)"
    # labelled by what differs from the reference (not by fp8.format=nvfp4, which every arm shares)
    assert [a.label for a in result.compared] == ["loss.importance_sampling=none", "loss.importance_sampling=icepop"]
    for arm in result.compared:
        per_seed = CORRECTIONS[arm.label.split("=")[1]]
        acc = np.array([a for _, _, a in per_seed])
        e = arm.effects[f"final_{M_VAL_ACC}"]
        np.testing.assert_allclose(e.differences, acc, rtol=1e-9, atol=1e-12)
        assert (e.ci_low, e.ci_high) == tuple(pytest.approx(x, rel=1e-6) for x in _scipy_interval(acc))
        ratio = np.log10([r for r, _, _ in per_seed])
        np.testing.assert_allclose(arm.effects[MISMATCH_LOG].differences, ratio, rtol=1e-9, atol=1e-12)
    assert result.compared[1].effects[f"final_{M_VAL_ACC}"].verdict == HIGHER
    # without the reference the same runs have no default arm, and the message says how to name one
    with pytest.raises(ValueError, match=r"no default arm: .*or an analysis\.reference naming the arm to pair with"):
        analyze(correction_runs())
    with pytest.raises(ValueError, match=r"no reference arm: no run has the knobs of analysis\.reference "
                                         r"\(fp8\.format=nvfp4, .*loss\.importance_sampling=token\); arms found "
                                         r"\(labelled by what differs from it\): loss\.importance_sampling=icepop"):
        analyze(correction_runs(token=False), cfg)


def test_report_names_the_reference(sqlite_uri, tmp_path):
    log_sweep(sqlite_uri, "fp8rl", "corrections", correction_runs())
    cfg = AnalysisConfig(kind="numerics", reference=REFERENCE)
    rep = make_numerics_report(sqlite_uri, "fp8rl", "corrections", tmp_path, config=cfg, log_artifacts=False)
    js = json.loads(rep.json.read_text())
    assert js["config"]["reference"] == REFERENCE and js["config"]["reference_arm"] == "reference"
    assert js["order"] == ["loss.importance_sampling=none", "loss.importance_sampling=icepop"]
    table = rep.table_md.read_text()
    assert table.startswith("# Numerics: each knob vs the reference (fp8.format=nvfp4 + "
                            "loss.importance_sampling=token)")
    assert "| effect (knob − reference) |" in table and "(3 reference runs) (reference: fp8.format=nvfp4 + " in table
    assert rep.verdicts_text.startswith("Numerics (paired by seed vs reference, 95% t intervals):")
    # without the key the default report's words are as before
    assert "knob − default" in markdown_table(analyze(numerics_runs()))


def test_episodes_pair_with_the_reference_arm():
    """A flagged reference run (every step above the band's 1.1) takes its seed's pair of every arm."""
    runs = correction_runs()
    runs[0] = _run("token", 0, {**NVFP4, "loss.importance_sampling": "token"}, 0.5, BASE_KL[0], BASE_ACC[0])
    band = EpisodeBand(max_flagged_fraction=0.3)  # the two spikes of every synthetic run (2 of 10 steps) pass
    result = analyze(runs, AnalysisConfig(kind="numerics", reference=REFERENCE, episodes=band))
    eps = result.episodes
    assert eps.base == "reference" and eps.flagged_seeds == {"reference": {"0"}}
    assert all(eps.pair_seeds(a.label) == {"0"} for a in result.compared)
    assert eps.labels[0] == "reference/seed 0" and "reference: 1/3 runs flagged" in eps.figure_note()
    assert "leaving out the 1 flagged run (reference/seed 0)" in eps.sensitivity.line
