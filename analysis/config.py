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
  per-knob paired effects against the default recipe (`analysis.numerics`, Figure 3). `to_dict` leaves it
  out while it is `claims`, so a claims report's files are what they were before the key existed.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fp8rl_core.tracking import M_VAL_ACC, M_VAL_ACC_BF16_EVAL

SECTION = "analysis"
ACCURACY_METRICS = (M_VAL_ACC, M_VAL_ACC_BF16_EVAL)  # accuracy_metric's allowed values
ACCURACY_LABELS = {M_VAL_ACC: "val accuracy", M_VAL_ACC_BF16_EVAL: "val accuracy, BF16 eval engine"}
CLAIMS, NUMERICS = "claims", "numerics"
KINDS = (CLAIMS, NUMERICS)  # kind's allowed values
CHOICES = {"accuracy_metric": ACCURACY_METRICS, "kind": KINDS}  # the string fields and their allowed values


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
    kind: str = CLAIMS  # last: the unknown-key message lists the older keys first, as before

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
        if not isinstance(raw, Mapping):
            raise ValueError(f"{where}: expected a mapping of keys to values, got {type(raw).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(raw) - set(names))
        if unknown:
            raise ValueError(f"{where}.{unknown[0]}: unknown key; valid keys are: {', '.join(names)}")
        values = {}
        for f in dataclasses.fields(cls):
            if f.name in raw:
                values[f.name] = _coerce(f"{where}.{f.name}", raw[f.name], f.default)
        try:
            return cls(**values)
        except ValueError as e:
            raise ValueError(f"{where}.{e}") from None

    @property
    def other_accuracy_metric(self) -> str:
        """The accuracy metric that does not decide (shown beside the deciding one)."""
        return next(m for m in ACCURACY_METRICS if m != self.accuracy_metric)

    def to_dict(self) -> dict[str, Any]:
        """Every field; `kind` only when it is not `claims` (claims.json's config is unchanged)."""
        out = dataclasses.asdict(self)
        if self.kind == CLAIMS:
            del out["kind"]
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
    ]
    for name, ok, want in rules:
        value = getattr(c, name)
        if isinstance(value, float) and not math.isfinite(value) or not ok:
            raise ValueError(f"{name}: {value!r} is invalid; expected {want}")
