"""train.mismatch_guard: validated at the edge (errors name the key and what is allowed), off by default,
and in the cell id only where it can act, so that every id written before it existed stays the same."""
from __future__ import annotations

import pytest

from fp8rl_core.config import RECIPES, hashed_dict, load_run_config, run_config_hash, strip_unhashed
from fp8rl_core.config.schema import ConfigError, stable_hash, to_dict

G = "train.mismatch_guard"


def _id_before_the_guard(cfg) -> str:
    """The id this config had before train.mismatch_guard existed: its dict without the section."""
    data = to_dict(cfg)
    data["train"].pop("mismatch_guard")
    return stable_hash(strip_unhashed(data))


def _id(*overrides: str) -> str:
    return run_config_hash(load_run_config(None, list(overrides)))


def test_off_by_default():
    g = load_run_config(None, []).train.mismatch_guard
    assert (g.action, g.max_mismatch, g.max_grad_norm, g.enabled) == ("none", 1.1, 0.0, False)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_the_default_keeps_every_id(recipe):
    for off in ([], [f"{G}.action=none"], [f"{G}.max_grad_norm=0"],
                [f"{G}.action=none", f"{G}.max_mismatch=1.5"],  # max_mismatch cannot act without an action
                [f"{G}.max_grad_norm=-1"]):  # <= 0 is off
        cfg = load_run_config(None, [f"recipe={recipe}", *off])
        assert not cfg.train.mismatch_guard.enabled
        assert run_config_hash(cfg) == _id_before_the_guard(cfg), off
        assert "mismatch_guard" not in hashed_dict(cfg)["train"]


def test_a_guard_that_can_act_is_a_new_cell():
    arms = [[], [f"{G}.action=skip"], [f"{G}.action=mask"], [f"{G}.max_grad_norm=100"],
            [f"{G}.action=skip", f"{G}.max_mismatch=1.05"], [f"{G}.action=skip", f"{G}.max_grad_norm=100"]]
    ids = [_id(*a) for a in arms]
    assert len(set(ids)) == len(arms)
    cfg = load_run_config(None, [f"{G}.action=mask", f"{G}.max_mismatch=1.2"])
    assert hashed_dict(cfg)["train"]["mismatch_guard"] == {"action": "mask", "max_mismatch": 1.2, "max_grad_norm": 0.0}
    # spellings of one numerics share an id: an off gradient-norm guard is off however it is written
    assert _id(f"{G}.action=skip", f"{G}.max_grad_norm=-5") == _id(f"{G}.action=skip")


@pytest.mark.parametrize("override, message", [
    (f"{G}.action=drop", f"{G}.action: 'drop' is not allowed; valid: none, skip, mask"),
    (f"{G}.max_mismatch=1", f"{G}.max_mismatch: must be > 1, got 1.0 (token_mult_prob_error >= 1"),
    (f"{G}.max_mismatch=0.5", f"{G}.max_mismatch: must be > 1, got 0.5"),
    (f"{G}.max_grad_norm=.inf", f"{G}.max_grad_norm: must be a finite number, got inf"),
    (f"{G}.max_grad_norm=big", f"{G}.max_grad_norm: expected float"),
    (f"{G}.limit=2", f"{G}.limit: unknown key; valid: action, max_mismatch, max_grad_norm"),
])
def test_bad_values_name_the_key_and_what_is_allowed(override, message):
    with pytest.raises(ConfigError) as e:
        load_run_config(None, [override])
    assert message in str(e.value)


@pytest.mark.parametrize("override, key", [(f"{G}.action=skip", "action"), (f"{G}.action=mask", "action"),
                                           (f"{G}.max_grad_norm=10", "max_grad_norm")])
def test_refused_outside_the_native_training_engine(override, key):
    with pytest.raises(ConfigError, match=rf"{G}\.{key}: the guard runs in the native training engine only; "
                                          r"engines.training is 'megatron'; valid: .*engines.training native"):
        load_run_config(None, ["engines.training=megatron", override])
    load_run_config(None, ["engines.training=megatron", f"{G}.action=none"])  # off: nothing to refuse


PATHS = [["optim.micro_steps=2"], ["engines.kernels=matched"], ["train.reuse_old_logprobs=false"],
         ["recipe=fp8_e2e", "loss.importance_sampling=token"]]


@pytest.mark.parametrize("extra", PATHS)
def test_works_with_every_native_path(extra):
    """The decision has a place on each path (docs/design.md): nothing to refuse there."""
    assert load_run_config(None, [f"{G}.action=mask", *extra]).train.mismatch_guard.enabled
