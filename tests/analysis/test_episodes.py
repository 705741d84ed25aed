"""Instability episodes: the band in `analysis:` (validated at the edge), per-run detection on synthetic
histories, the per-arm rate and its exact interval (against scipy's beta quantiles), the figures' marks."""
from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from analysis.config import AnalysisConfig, EpisodeBand
from analysis.episodes import (
    MERGE_GAP,
    RATE_LEVEL,
    accuracy_drops,
    arm_rates,
    detect,
    episode_rate,
    group_marks,
    step_ranges,
)
from analysis.fetch import RunHistory
from analysis.kernel_match import KERNELS_PARAM, MATCHED
from fp8rl_core.tracking import M_MISMATCH, M_VAL_ACC, M_VAL_ACC_BF16_EVAL

# --- the band ----------------------------------------------------------------------------------------


def test_band_defaults_apply_without_the_block_and_stay_out_of_to_dict():
    for cfg in (AnalysisConfig(), AnalysisConfig.from_dict(None), AnalysisConfig.from_dict({"alpha": 0.05}),
                AnalysisConfig.from_dict({"episodes": None}), AnalysisConfig.from_dict({"episodes": {}})):
        assert cfg.episodes == EpisodeBand(1.1, 0.05, 10.0)
        assert "episodes" not in cfg.to_dict()  # claims.json's config as before the key existed
    custom = AnalysisConfig.from_dict({"episodes": {"mismatch_above": 2, "accuracy_drop": 5}})
    assert custom.episodes == EpisodeBand(2.0, 0.05, 5.0) and isinstance(custom.episodes.mismatch_above, float)
    assert custom.to_dict()["episodes"] == {"mismatch_above": 2.0, "max_flagged_fraction": 0.05, "accuracy_drop": 5.0}
    assert AnalysisConfig.from_dict(custom.to_dict()) == custom


@pytest.mark.parametrize("raw,message", [
    ({"episodes": {"mismatch_above": 1}}, r"analysis\.episodes\.mismatch_above: 1\.0 is invalid; expected a ratio "
                                          r"above 1"),
    ({"episodes": {"mismatch_above": float("inf")}}, r"analysis\.episodes\.mismatch_above: inf is invalid"),
    ({"episodes": {"max_flagged_fraction": 1}}, r"analysis\.episodes\.max_flagged_fraction: 1\.0 is invalid; "
                                                r"expected a fraction of steps in \[0, 1\)"),
    ({"episodes": {"max_flagged_fraction": -0.1}}, r"analysis\.episodes\.max_flagged_fraction: -0\.1 is invalid"),
    ({"episodes": {"accuracy_drop": 0}}, r"analysis\.episodes\.accuracy_drop: 0\.0 is invalid; expected accuracy "
                                         r"points in \(0, 100\)"),
    ({"episodes": {"accuracy_drop": "10 pts"}}, r"analysis\.episodes\.accuracy_drop: expected a number, got '10 pts'"),
    ({"episodes": {"accuracy_drop": True}}, r"analysis\.episodes\.accuracy_drop: expected a number, got True"),
    ({"episodes": {"mismatch": 1.2}}, r"analysis\.episodes\.mismatch: unknown key; valid keys are: mismatch_above, "
                                      r"max_flagged_fraction, accuracy_drop"),
    ({"episodes": 1.1}, r"analysis\.episodes: expected a mapping of keys to values, got float"),
    ({"episode": {}}, r"analysis\.episode: unknown key; valid keys are: .*, kind, episodes"),
])
def test_band_errors_name_the_key_and_what_is_allowed(raw, message):
    with pytest.raises(ValueError, match=message):
        AnalysisConfig.from_dict(raw)


def test_band_built_directly_is_checked_too():
    with pytest.raises(ValueError, match=r"^accuracy_drop: 150\.0 is invalid"):
        EpisodeBand(accuracy_drop=150.0)
    with pytest.raises(ValueError, match=r"^episodes: .* is invalid; expected an EpisodeBand"):
        AnalysisConfig(episodes={"mismatch_above": 1.2})


# --- detection ---------------------------------------------------------------------------------------


def _run(mm: np.ndarray | None = None, steps: np.ndarray | None = None, acc: np.ndarray | None = None,
         val_steps: np.ndarray | None = None, recipe: str = "fp8_e2e", isv: str = "token", seed: int = 2,
         run_id: str = "", params: dict | None = None, acc_key: str = M_VAL_ACC) -> RunHistory:
    metrics = {}
    if mm is not None:
        steps = np.arange(mm.size) if steps is None else steps
        metrics[M_MISMATCH] = (np.asarray(steps, np.int64), np.asarray(mm, np.float64))
    if acc is not None:
        metrics[acc_key] = (np.asarray(val_steps, np.int64), np.asarray(acc, np.float64))
    tags = {"recipe": recipe, "importance_sampling": isv, "seed": str(seed)}
    return RunHistory(run_id, "", "FINISHED", tags, params or {}, metrics)


def collapse() -> tuple[RunHistory, np.ndarray, np.ndarray]:
    """The fp8_e2e run of the report: 1.00–1.04 until step 53, a 20-step collapse (310 at 56, 2416 at 66,
    2659 at 72, two dips under the band inside it), back to 1.008 by 80; accuracy 75% -> 34% at 60 -> 74.6%."""
    rng = np.random.default_rng(7)
    mm = 1.0 + rng.uniform(0.0, 0.04, 81)
    mm[54:77] = np.geomspace(1.5, 2000, 23)
    mm[[56, 66, 72]] = 310.0, 2416.0, 2659.0
    mm[[60, 61, 69]] = 1.05, 1.02, 1.09  # dips of 2 and 1 logged steps: the collapse is not over
    mm[80] = 1.008
    val_steps = np.arange(0, 81, 10)
    acc = np.array([0.30, 0.45, 0.58, 0.68, 0.72, 0.75, 0.34, 0.52, 0.746])
    return _run(mm, acc=acc, val_steps=val_steps), mm, acc


def test_a_collapse_is_one_episode_with_its_range_peak_and_accuracy_drop():
    run, mm, acc = collapse()
    e = detect(run)
    assert e.steps == 81 and e.flagged_steps == int((mm > 1.1).sum())
    assert e.ranges == ((54, 76),)  # the dips at 60–61 and 69 are bridged
    assert e.flagged_fraction == pytest.approx((mm > 1.1).mean()) and e.mismatch_episode
    assert (e.peak_mismatch, e.peak_step) == (mm.max(), int(np.argmax(mm)))
    best_before = np.maximum.accumulate(acc)[:-1]
    drops = 100 * (best_before - acc[1:])
    assert e.accuracy_steps == tuple(int(s) for s in np.arange(10, 81, 10)[drops > 10])  # 60 and 70
    assert e.worst_drop == pytest.approx(drops.max()) and e.worst_drop_step == 10 * (1 + int(np.argmax(drops)))
    assert e.accuracy_episode and e.has_episode
    assert e.label == "fp8_e2e/token/seed 2" and e.steps_text == "54-76; val 60,70"


def test_one_isolated_spike_in_80_steps_is_not_an_episode_under_the_defaults():
    mm = np.full(80, 1.02)
    mm[40] = 181.0
    e = detect(_run(mm))
    assert (e.flagged_steps, e.ranges, e.peak_mismatch, e.peak_step) == (1, ((40, 40),), 181.0, 40)
    assert not e.mismatch_episode and not e.has_episode and e.steps_text == "none"
    assert detect(_run(mm), EpisodeBand(max_flagged_fraction=0.0)).has_episode  # the fraction is what decides


def test_the_flagged_fraction_must_exceed_the_band():
    mm = np.full(100, 1.02)
    mm[:5] = 2.0  # exactly 5%: not more than 5%
    assert not detect(_run(mm)).mismatch_episode
    mm[5] = 2.0
    assert detect(_run(mm)).mismatch_episode


def test_an_accuracy_drop_of_more_than_the_band_below_the_best_earlier_validation_flags():
    steps = np.arange(0, 50, 10)
    # each step falls <= 6 pts from the one before, but 11 pts below the best earlier (75%)
    e = detect(_run(acc=np.array([0.60, 0.75, 0.70, 0.64, 0.66]), val_steps=steps))
    assert e.accuracy_steps == (30,) and e.worst_drop == pytest.approx(11.0) and e.has_episode
    assert not detect(_run(acc=np.array([0.60, 0.75, 0.70, 0.651, 0.66]), val_steps=steps)).has_episode  # 9.9 pts
    assert detect(_run(acc=np.array([0.60, 0.75, 0.70, 0.64, 0.66]), val_steps=steps),
                  EpisodeBand(accuracy_drop=12)).accuracy_steps == ()
    # the accuracy read is the metric asked for (analysis.accuracy_metric)
    other = _run(acc=np.array([0.60, 0.75, 0.40]), val_steps=steps[:3], acc_key=M_VAL_ACC_BF16_EVAL)
    assert not detect(other).has_episode and detect(other, metric=M_VAL_ACC_BF16_EVAL).accuracy_steps == (20,)


def test_nan_and_missing_steps():
    steps = np.r_[np.arange(0, 30), np.arange(35, 60)]  # steps 30–34 were never logged
    mm = np.full(steps.size, 1.01)
    at = {s: i for i, s in enumerate(steps)}
    for s in (27, 28, 29, 35, 36):  # flagged on both sides of the missing steps: one range
        mm[at[s]] = 50.0
    mm[at[10]] = np.nan  # measured nothing: neither flagged nor counted
    mm[at[50]] = np.inf  # a blow-up: flagged
    e = detect(_run(mm, steps))
    assert e.steps == steps.size - 1 and e.flagged_steps == 6
    assert e.ranges == ((27, 36), (50, 50)) and e.mismatch_episode and e.peak_mismatch == np.inf
    acc = detect(_run(acc=np.array([0.5, np.nan, 0.7, np.nan, 0.55]), val_steps=np.arange(0, 50, 10)))
    assert acc.accuracy_steps == (40,) and acc.worst_drop == pytest.approx(15.0)
    empty = detect(_run())
    assert (empty.steps, empty.flagged_fraction, empty.has_episode, empty.steps_text) == (0, 0.0, False, "none")
    assert np.isnan(empty.peak_mismatch) and np.isnan(empty.worst_drop) and empty.peak_step is None
    assert np.isnan(accuracy_drops(np.array([0.5]))[0]) and accuracy_drops(np.zeros(0)).size == 0


def test_ranges_bridge_at_most_merge_gap_unflagged_steps():
    steps = np.arange(20)
    flagged = np.zeros(20, bool)
    flagged[[2, 3, 3 + MERGE_GAP + 1]] = True  # MERGE_GAP unflagged steps between 3 and the next
    flagged[[10, 10 + MERGE_GAP + 2]] = True  # one more: a new range
    assert step_ranges(steps, flagged) == [(2, 3 + MERGE_GAP + 1), (10, 10), (10 + MERGE_GAP + 2, 10 + MERGE_GAP + 2)]
    assert step_ranges(steps, np.zeros(20, bool)) == []


# --- rates -------------------------------------------------------------------------------------------


def _clopper_pearson(k: int, n: int, level: float) -> tuple[float, float]:
    a = 1 - level
    lo = 0.0 if k == 0 else stats.beta.ppf(a / 2, k, n - k + 1)
    hi = 1.0 if k == n else stats.beta.ppf(1 - a / 2, k + 1, n - k)
    return lo, hi


@pytest.mark.parametrize("k,n", [(0, 3), (1, 3), (3, 3), (2, 5), (1, 10)])
def test_rate_and_its_exact_interval(k, n):
    flagged, calm = detect(collapse()[0]), detect(_run(np.full(10, 1.02)))
    rate = episode_rate([flagged] * k + [calm] * (n - k))
    assert (rate.k, rate.n) == (k, n) and rate.rate == pytest.approx(k / n)
    assert rate.ci == pytest.approx(_clopper_pearson(k, n, RATE_LEVEL), abs=1e-9)
    assert rate.text().startswith(f"{k}/{n} [")
    assert episode_rate([]).n == 0 and episode_rate([]).text() == "0/0"


def test_arm_rates_group_distinct_runs_by_recipe_and_is():
    run, _, _ = collapse()
    calm = [_run(np.full(10, 1.02), recipe=rc, isv=isv, seed=s) for rc in ("fp8_e2e", "bf16")
            for isv in ("token", "none") for s in (0, 1)]
    floor = _run(np.full(10, 5.0), recipe="bf16", isv="none", seed=0, params={KERNELS_PARAM: MATCHED})
    arms = arm_rates([*calm, run, floor], AnalysisConfig())
    assert [tuple(a.group.values()) for a in arms] == [("bf16", "none"), ("bf16", "token"), ("fp8_e2e", "none"),
                                                       ("fp8_e2e", "token")]  # the summary table's order
    assert [(a.rate.k, a.rate.n) for a in arms] == [(0, 2), (0, 2), (0, 2), (1, 3)]  # the matched run: no arm's
    assert arms[-1].flagged == ("fp8_e2e/token/seed 2",) and arms[-1].to_dict()["ci"][0] > 0
    assert detect(floor).has_episode and detect(floor).label.endswith(", matched kernels")


def test_group_marks_are_the_flagged_steps_of_runs_with_an_episode():
    run, mm, _ = collapse()
    spike = _run(np.r_[np.full(40, 1.02), 181.0, np.full(39, 1.02)], recipe="bf16", isv="none", seed=0)
    marks = group_marks([run, spike], ("recipe",))
    assert list(marks) == [("fp8_e2e",)]  # the isolated spike's run has no episode: no mark
    np.testing.assert_array_equal(marks[("fp8_e2e",)], np.flatnonzero(mm > 1.1))
    acc_marks = group_marks([run, spike], ("recipe", "importance_sampling"), key=M_VAL_ACC)
    np.testing.assert_array_equal(acc_marks[("fp8_e2e", "token")], [60, 70])  # dropped, and inside 54-76
