"""AnalysisConfig: defaults, the sweep file's `analysis:` block, errors that name the key."""
from __future__ import annotations

import pytest

from analysis.config import AnalysisConfig


def test_defaults_and_from_dict():
    cfg = AnalysisConfig()
    assert (cfg.equivalence_margin, cfg.alpha, cfg.power, cfg.seed) == (2.0, 0.05, 0.8, 0)
    assert cfg.margin == pytest.approx(0.02)
    assert AnalysisConfig.from_dict(None) == cfg and AnalysisConfig.from_dict({}) == cfg
    custom = AnalysisConfig.from_dict({"equivalence_margin": 3, "alpha": 0.1, "bootstrap_resamples": 500.0,
                                       "is_variant": "tis"})
    assert custom.equivalence_margin == 3.0 and isinstance(custom.bootstrap_resamples, int)
    assert custom.is_variant == "tis" and AnalysisConfig.from_dict(custom.to_dict()) == custom
    assert cfg.accuracy_metric == "val_accuracy" and cfg.other_accuracy_metric == "val_accuracy_bf16_eval"
    bf16_eval = AnalysisConfig.from_dict({"accuracy_metric": "val_accuracy_bf16_eval"})
    assert bf16_eval.other_accuracy_metric == "val_accuracy" and bf16_eval.to_dict()["accuracy_metric"] == \
        "val_accuracy_bf16_eval"


@pytest.mark.parametrize("raw,message", [
    ({"equivalence_margn": 2}, r"analysis\.equivalence_margn: unknown key; valid keys are: equivalence_margin, alpha"),
    ({"equivalence_margin": -1}, r"analysis\.equivalence_margin: -1\.0 is invalid; expected accuracy points"),
    ({"equivalence_margin": "2%"}, r"analysis\.equivalence_margin: expected a number, got '2%'"),
    ({"alpha": 0.7}, r"analysis\.alpha: 0\.7 is invalid"),
    ({"alpha": float("nan")}, r"analysis\.alpha: nan is invalid"),
    ({"power": 1}, r"analysis\.power: 1\.0 is invalid"),
    ({"bootstrap_resamples": 10.5}, r"analysis\.bootstrap_resamples: expected an integer"),
    ({"bootstrap_resamples": 10}, r"analysis\.bootstrap_resamples: 10 is invalid; expected an integer >= 100"),
    ({"seed": True}, r"analysis\.seed: expected a number, got True"),
    ({"is_variant": 3}, r"analysis\.is_variant: expected an IS variant name"),
    ({"accuracy_metric": "val_acc"}, r"analysis\.accuracy_metric: 'val_acc' is invalid; expected one of: "
                                     r"val_accuracy, val_accuracy_bf16_eval"),
    ({"accuracy_metric": None}, r"analysis\.accuracy_metric: expected one of: val_accuracy, val_accuracy_bf16_eval; "
                                r"got None"),
])
def test_errors_name_the_key(raw, message):
    with pytest.raises(ValueError, match=message):
        AnalysisConfig.from_dict(raw)


def test_not_a_mapping_and_direct_construction():
    with pytest.raises(ValueError, match="analysis: expected a mapping"):
        AnalysisConfig.from_dict([1, 2])
    with pytest.raises(ValueError, match="trim: 0.6 is invalid"):
        AnalysisConfig(trim=0.6)
