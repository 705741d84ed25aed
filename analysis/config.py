"""`AnalysisConfig`: the knobs of the claim checks, typed and validated at the edge (the sweep file).

    cfg = AnalysisConfig.from_dict(spec.get("analysis", {}))    # the sweep file's `analysis:` block
    check_claims(data, cfg)

Fields (all optional in the sweep file):
- `equivalence_margin` (accuracy points, default 2.0): claim 4's TOST margin ±m on the paired
  difference of final validation accuracy (val_accuracy is a fraction; 2 points = 0.02);
- `alpha` (default 0.05): the level of every test. Difference claims use the two-sided (1 − α)
  t interval (PASS and FAIL each spend α/2); TOST uses the (1 − 2α) interval (90% at α = 0.05);
- `power` (default 0.8): the target power of the power lines;
- `bootstrap_resamples` (default 9999) and `seed` (default 0): scipy.stats.bootstrap's resamples and
  random state, fixed so that a report is reproducible;
- `trim` (default 0.1): the proportion cut from each end for the trimmed-mean view of mismatch;
- `is_variant` (default None: `token` if present, else the first other variant by name): the IS
  setting that claims 3–4 read as "with IS";
- `accuracy_metric` (default `val_accuracy`): the validation metric claims 3–4 decide on, Figure 2
  plots and the RL-evaluation tables score. `val_accuracy`: each arm through its own generation
  engine (FP8 inference and FP8-trained weights together); `val_accuracy_bf16_eval`: the same prompts
  and samples through one BF16 engine for every arm (the weights alone). Declare it in the sweep file
  before the study runs; the report shows claims 3–4 on the other metric too, marked not deciding.
- `kind` (default `claims`): what the report stage (`sweep run`, `sweep report`, `analysis.report.make_report`)
  writes: `claims` the ablation's figures, tables and claims 1–4; `numerics` the numerics study's
  per-knob paired effects against the default recipe (`analysis.numerics`, Figure 3); `engines` the engine
  arms' mismatch, paired by seed (`analysis.engines`: Figure 1 per recipe · generation engine, e.g.
  "bf16 · vLLM", the per-run medians, the ordering fractions, claims 1–2 against the real-kernel
  baseline). `to_dict` leaves it
  out while it is `claims`, so a claims report's files are what they were before the key existed.
- `episodes` (a nested mapping, `EpisodeBand`; default: the band below, so every report flags
  instability episodes even when the sweep file has no `episodes:` block): `mismatch_above` (1.1: a step
  is flagged when its token_mult_prob_error exceeds it, NeMo RL's gate), `max_flagged_fraction` (0.05: a
  run has an episode when more than this fraction of its steps are flagged) and `accuracy_drop` (10.0
  accuracy points: a validation step of `accuracy_metric` more than this below the run's best earlier
  validation is flagged, and its run has an episode). `analysis.episodes` reads the band; it never enters
  a claim's verdict. `to_dict` leaves it out while it is the default band (claims.json's config as before).
- `reference` (a mapping knob -> value, numerics reports only; default: empty, every knob at its default): the
  arm every other arm is paired against (`analysis.numerics_arms`), e.g. `{fp8.format: nvfp4,
  loss.importance_sampling: token}`; the knobs it does not name stay at their defaults. Keys: the numerics
  knobs (`analysis.numerics_arms.KNOB_DEFAULTS`). `to_dict` leaves it out while it is empty.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from analysis.numerics_arms import KNOB_DEFAULTS
from fp8rl_core.tracking import M_VAL_ACC, M_VAL_ACC_BF16_EVAL

SECTION = "analysis"
ACCURACY_METRICS = (M_VAL_ACC, M_VAL_ACC_BF16_EVAL)  # accuracy_metric's allowed values
ACCURACY_LABELS = {M_VAL_ACC: "val accuracy", M_VAL_ACC_BF16_EVAL: "val accuracy, BF16 eval engine"}
CLAIMS, NUMERICS, ENGINES = "claims", "numerics", "engines"
KINDS = (CLAIMS, NUMERICS, ENGINES)  # kind's allowed values
CHOICES = {"accuracy_metric": ACCURACY_METRICS, "kind": KINDS}  # the string fields and their allowed values
EPISODES = "episodes"  # the nested mapping's key in `analysis:`
REFERENCE = "reference"  # the numerics report's reference arm: a mapping knob -> value


@dataclass(frozen=True)
class EpisodeBand:
    """The sweep file's `analysis.episodes`: when a step, and a run, count as an instability episode.

    Flagged steps: token_mult_prob_error x_t > `mismatch_above`; validation steps v whose accuracy
    a_v (a fraction) satisfies 100 · (max_{u<v} a_u − a_v) > `accuracy_drop`. A run has an episode iff
    (flagged mismatch steps) / (logged mismatch steps) > `max_flagged_fraction`, or a validation step
    is flagged. Detection: the module `analysis.episodes`."""

    mismatch_above: float = 1.1
    max_flagged_fraction: float = 0.05
    accuracy_drop: float = 10.0

    def __post_init__(self) -> None:
        rules = [
            ("mismatch_above", self.mismatch_above > 1,
             "a ratio above 1 (token_mult_prob_error is >= 1 by definition; 1 would flag every step), e.g. 1.1"),
            ("max_flagged_fraction", 0 <= self.max_flagged_fraction < 1, "a fraction of steps in [0, 1), e.g. 0.05"),
            ("accuracy_drop", 0 < self.accuracy_drop < 100, "accuracy points in (0, 100), e.g. 10"),
        ]
        _apply(self, rules)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None, where: str = f"{SECTION}.{EPISODES}") -> EpisodeBand:
        """From the `episodes:` mapping; errors name the key (`analysis.episodes.mismatch_above`)."""
        if raw is None:
            return cls()
        return _build(cls, raw, where)


@dataclass(frozen=True)
class AnalysisConfig:
    equivalence_margin: float = 2.0
    alpha: float = 0.05
    power: float = 0.8
    bootstrap_resamples: int = 9999
    seed: int = 0
    trim: float = 0.1
    is_variant: str | None = None
    accuracy_metric: str = M_VAL_ACC
    kind: str = CLAIMS  # after the older keys: the unknown-key message lists them first, as before
    episodes: EpisodeBand = field(default_factory=EpisodeBand)  # the instability band (analysis.episodes)
    reference: dict[str, str] = field(default_factory=dict)  # numerics: the arm paired against (knob -> value)

    def __post_init__(self) -> None:
        _check(self)

    @property
    def margin(self) -> float:
        """The TOST margin as a fraction of accuracy (`equivalence_margin` / 100)."""
        return self.equivalence_margin / 100.0

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None, where: str = SECTION) -> AnalysisConfig:
        """From the sweep file's `analysis:` mapping; errors name the key (`analysis.alpha`) and the fix."""
        if raw is None:
            return cls()
        return _build(cls, raw, where)

    @property
    def other_accuracy_metric(self) -> str:
        """The accuracy metric that does not decide (shown beside the deciding one)."""
        return next(m for m in ACCURACY_METRICS if m != self.accuracy_metric)

    def to_dict(self) -> dict[str, Any]:
        """Every field; `kind` only when it is not `claims` and `episodes` only when it is not the default
        band (claims.json's config is unchanged for a sweep file that does not set them)."""
        out = dataclasses.asdict(self)
        if self.kind == CLAIMS:
            del out["kind"]
        if self.episodes == EpisodeBand():
            del out[EPISODES]
        if not self.reference:
            del out[REFERENCE]
        return out


def _build(cls: type, raw: Any, where: str) -> Any:
    """`cls` (AnalysisConfig or EpisodeBand) from a sweep-file mapping; every error names its key from
    `where` down (`analysis.episodes.accuracy_drop: ...`)."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: expected a mapping of keys to values, got {type(raw).__name__}")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(raw) - set(names), key=str)
    if unknown:
        raise ValueError(f"{where}.{unknown[0]}: unknown key; valid keys are: {', '.join(names)}")
    values = {}
    for f in dataclasses.fields(cls):
        if f.name == EPISODES and f.name in raw:  # the nested band: validated with its own keys
            values[f.name] = EpisodeBand.from_dict(raw[f.name], f"{where}.{f.name}")
        elif f.name == REFERENCE and f.name in raw:
            values[f.name] = _reference(raw[f.name], f"{where}.{f.name}")
        elif f.name in raw:
            values[f.name] = _coerce(f"{where}.{f.name}", raw[f.name], f.default)
    try:
        return cls(**values)
    except ValueError as e:  # "<field>: ..." from the rules: name it from the file's section down
        raise ValueError(f"{where}.{e}") from None


def _reference(raw: Any, where: str) -> dict[str, str]:
    """`analysis.reference`: knob -> value, each value a scalar kept as the string a run's param holds."""
    allowed = ", ".join(KNOB_DEFAULTS)
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: expected a mapping of numerics knobs to values ({allowed}), got {raw!r}")
    out = {}
    for key, value in raw.items():
        if key not in KNOB_DEFAULTS:
            raise ValueError(f"{where}.{key}: not a numerics knob; valid knobs are: {allowed}")
        if isinstance(value, (Mapping, list, tuple)) or value is None:
            raise ValueError(f"{where}.{key}: expected one value (a string or number), got {value!r}")
        out[key] = str(value).lower() if isinstance(value, bool) else str(value)
    return out


def _coerce(key: str, value: Any, default: Any) -> Any:
    if default is None:  # is_variant
        if value is None or isinstance(value, str):
            return value
        raise ValueError(f"{key}: expected an IS variant name (a string), got {value!r}")
    if isinstance(default, str):  # accuracy_metric, kind: which names are allowed is _check's rule
        if isinstance(value, str):
            return value
        raise ValueError(f"{key}: expected one of: {', '.join(CHOICES[key.rsplit('.', 1)[-1]])}; got {value!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key}: expected a number, got {value!r}")
    if isinstance(default, int) and not float(value).is_integer():
        raise ValueError(f"{key}: expected an integer, got {value!r}")
    return type(default)(value)


def _check(c: AnalysisConfig) -> None:
    """Raise `ValueError('<field>: ...')` for the first invalid field."""
    rules = [
        ("equivalence_margin", 0 < c.equivalence_margin < 100, "accuracy points in (0, 100), e.g. 2"),
        ("alpha", 0 < c.alpha < 0.5, "a test level in (0, 0.5), e.g. 0.05"),
        ("power", 0 < c.power < 1, "a target power in (0, 1), e.g. 0.8"),
        ("bootstrap_resamples", c.bootstrap_resamples >= 100, "an integer >= 100, e.g. 9999"),
        ("seed", c.seed >= 0, "a non-negative integer"),
        ("trim", 0 <= c.trim < 0.5, "a proportion in [0, 0.5), e.g. 0.1"),
        ("accuracy_metric", c.accuracy_metric in ACCURACY_METRICS, "one of: " + ", ".join(ACCURACY_METRICS)),
        ("kind", c.kind in KINDS, "one of: " + ", ".join(KINDS)),
        (REFERENCE, isinstance(c.reference, dict) and set(c.reference) <= set(KNOB_DEFAULTS),
         "a mapping of numerics knobs to values; knobs: " + ", ".join(KNOB_DEFAULTS)),
        (REFERENCE, not c.reference or c.kind == NUMERICS, "unset: only a numerics report (analysis.kind: numerics) "
         "pairs arms with a reference"),
        (EPISODES, isinstance(c.episodes, EpisodeBand),
         "an EpisodeBand (in a sweep file: a mapping with keys " + ", ".join(f.name for f in dataclasses.fields(
             EpisodeBand)) + ")"),
    ]
    _apply(c, rules)


def _apply(obj: Any, rules: list[tuple[str, bool, str]]) -> None:
    """Raise `ValueError('<field>: <value> is invalid; expected <want>')` for the first failed rule
    (a non-finite float always fails)."""
    for name, ok, want in rules:
        value = getattr(obj, name)
        if isinstance(value, float) and not math.isfinite(value) or not ok:
            raise ValueError(f"{name}: {value!r} is invalid; expected {want}")
