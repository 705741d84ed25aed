"""Every numeric key of the run config has an allowed range (fp8rl_core.config.RANGES), checked at the
edge: a value outside it is refused by load_run_config (so by `fp8rl-train --print-config`, `sweep plan`
and `sweep run`) with an error naming the key and what is allowed, never inside a cell."""
from __future__ import annotations

import dataclasses
import math
import types
import typing

import pytest

from fp8rl_core.config import RANGES, RunConfig, load_run_config
from fp8rl_core.config.schema import ConfigError, Range


def leaf_type(tp: typing.Any) -> tuple[type | None, bool]:
    """(int or float, is a list) for a numeric annotation (optional ones too), else (None, False)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = args[0] if len(args) == 1 else None
    if typing.get_origin(tp) is list:
        inner, _ = leaf_type(typing.get_args(tp)[0])
        return inner, inner is not None
    return (tp, False) if tp in (int, float) else (None, False)


def numeric_keys(cls: type = RunConfig, prefix: str = "") -> dict[str, tuple[type, bool]]:
    """Dotted key -> (int or float, is a list) for every numeric leaf, walking the dataclass fields."""
    keys: dict[str, tuple[type, bool]] = {}
    for name, tp in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(tp):
            keys.update(numeric_keys(tp, f"{prefix}{name}."))
        elif leaf_type(tp)[0] is not None:
            keys[prefix + name] = leaf_type(tp)
    return keys


KEYS = numeric_keys()


def test_every_numeric_key_has_a_range_and_every_range_a_key():
    missing = sorted(set(KEYS) - set(RANGES))
    assert not missing, f"numeric run-config keys without an allowed range in RANGES (run_config.py): {missing}"
    assert not sorted(set(RANGES) - set(KEYS)), "RANGES names keys the run config does not have"
    assert {"train.steps", "engines.vllm.max_num_seqs", "optim.betas"} <= set(KEYS)  # nested, optional, list


def outside(rng: Range, kind: type) -> list[float]:
    """Values just outside each bound of `rng`; for a float key, infinity too (every range is finite)."""
    bad = [math.inf] if kind is float else []
    if rng.low is not None:
        bad.append(kind(rng.low if rng.open_low else rng.low - 1))
    if rng.high is not None:
        bad.append(kind(rng.high if rng.open_high else rng.high + 1))
    return bad


@pytest.mark.parametrize("key", sorted(KEYS))
def test_a_value_outside_the_range_is_refused_naming_the_key_and_the_range(key):
    kind, is_list = KEYS[key]
    rng = RANGES[key]
    for value in outside(rng, kind):
        text = ".inf" if value == math.inf else repr(value)
        with pytest.raises(ConfigError) as e:
            load_run_config(None, [f"{key}={f'[{text}]' if is_list else text}"])
        assert f"{key}{'[0]' if is_list else ''}: must be {rng}, got {value!r}" in str(e.value), str(e.value)


@pytest.mark.parametrize("override, message", [
    ("train.steps=-3", "train.steps: must be >= 1, got -3"),
    ("optim.lr=-1", "optim.lr: must be > 0, got -1.0"),
    ("train.checkpoint_every=-1", "train.checkpoint_every: must be >= 1, got -1"),
    ("rollout.top_p=0", "rollout.top_p: must be in (0, 1], got 0.0"),
    ("warmstart.target_accuracy=1.5", "warmstart.target_accuracy: must be in [0, 1], got 1.5"),
    ("optim.betas=[0.9, 1.0]", "optim.betas[1]: must be in [0, 1), got 1.0"),
    ("optim.betas=[0.9]", "optim.betas: expected 2 values, got 1"),
    ("loss.is_low=6", "loss.is_low: need is_low <= is_high, got 6.0 > 5.0"),
])
def test_the_reported_bad_values_are_refused(override, message):
    with pytest.raises(ConfigError) as e:
        load_run_config(None, [override])
    assert message in str(e.value)


def test_the_defaults_and_unset_optional_keys_pass():
    cfg = load_run_config(None, ["warmstart.target_accuracy=null", "engines.vllm.max_num_seqs=null"])
    assert cfg.warmstart.target_accuracy is None and cfg.engines.vllm.max_num_seqs is None


def test_print_config_refuses_a_bad_value_and_names_it(capsys):
    from fp8rl_core.cli import main

    assert main(["--print-config", "train.steps=-3"]) == 2
    assert "train.steps: must be >= 1, got -3" in capsys.readouterr().err
