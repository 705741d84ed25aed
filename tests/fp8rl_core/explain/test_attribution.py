"""Attribution replay: a variant known to be exact reads exactly 1.0, and an injected perturbation is located."""
from __future__ import annotations

import pytest
import torch

from fp8rl_core.engines.native_gen import NativeGenerationEngine
from fp8rl_core.explain.attribution import GenKernels, TrainKernels, compare, fake_quantize
from fp8rl_core.model import build_model, preset

LAYER = 2  # where the perturbation is injected (the tiny preset has 4 decoder layers)


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    cfg = preset("tiny")
    model = build_model(cfg)
    ids = torch.randint(3, cfg.vocab_size, (3, 10))
    attention = torch.ones(3, 10, dtype=torch.bool)
    attention[1, 7:] = False  # a shorter, right-padded row
    response = attention.clone()
    response[:, :4] = False
    return cfg, model, ids, attention, response


def _perturbed(model, cfg):
    other = build_model(cfg)
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        other.model.layers[LAYER].mlp.down_proj.weight.mul_(1.01)
    return other


def _gen(cfg, model):
    engine = NativeGenerationEngine(cfg, dtype=torch.bfloat16)
    engine.refit(model.state_dict())
    return GenKernels(engine, "gen", temperature=2.0)


def test_identical_kernels_give_exactly_one_in_bf16(setup):
    cfg, model, ids, am, rm = setup
    train = TrainKernels(model, "train", temperature=2.0)
    for side in (train, _gen(cfg, model)):
        r = compare(side, side, ids, am, rm)
        assert r.metrics["token_mult_prob_error"] == 1.0  # exactly: bitwise-identical log-probs
        assert r.metrics["logprob_abs_diff_max"] == 0.0
        assert r.layer_rel_err == [0.0] * cfg.num_hidden_layers
        assert r.first_divergent_layer is None and r.largest_jump_layer is None


@pytest.mark.parametrize("engine", ["train", "gen"])
def test_a_perturbation_injected_into_one_layer_is_located(setup, engine):
    cfg, model, ids, am, rm = setup
    other = _perturbed(model, cfg)
    if engine == "train":
        a, b = TrainKernels(model, "a", temperature=2.0), TrainKernels(other, "b", temperature=2.0)
    else:
        a, b = _gen(cfg, model), _gen(cfg, other)
    r = compare(a, b, ids, am, rm)
    assert r.layer_rel_err[:LAYER] == [0.0] * LAYER  # same kernels, same weights: bitwise equal before it
    assert r.layer_rel_err[LAYER] > 1e-4
    assert r.first_divergent_layer == LAYER and r.largest_jump_layer == LAYER
    assert r.metrics["token_mult_prob_error"] > 1.0


def test_different_kernels_disagree_from_the_first_layer(setup):
    """Generation vs training kernels in BF16: the study's BF16 mismatch (> 1), visible at layer 0."""
    cfg, model, ids, am, rm = setup
    r = compare(TrainKernels(model, "train", temperature=2.0), _gen(cfg, model), ids, am, rm)
    assert r.metrics["token_mult_prob_error"] > 1.0
    assert r.first_divergent_layer == 0


def test_fake_quantization_switches_one_error_source_at_a_time(setup):
    cfg, model, ids, am, rm = setup
    ref = TrainKernels(model, "bf16", temperature=2.0)
    names = fake_quantize(TrainKernels(model, "x").model, ("lm_head", "model.layers.0.*"), True, False)
    assert "lm_head" not in names and not any(n.startswith("model.layers.0.") for n in names)
    assert len(names) == 7 * (cfg.num_hidden_layers - 1)  # q, k, v, o, gate, up, down per converted layer
    errs = {}
    for w, a in [(True, False), (False, True), (True, True)]:
        side = TrainKernels(model, "q", temperature=2.0, quant_weights=w, quant_activations=a)
        errs[(w, a)] = compare(ref, side, ids, am, rm).layer_rel_err[0]
    assert all(e > 0 for e in errs.values())
    assert errs[(True, True)] > max(errs[(True, False)], errs[(False, True)])  # the two errors add up


def test_the_catalogues_new_views_reach_the_replay(setup):
    """Issue 34's metrics (order statistics, k2, splits) are in every variant's metrics; with the rollout's
    advantages the sign splits are measured, without them nan."""
    import math

    from fp8rl_core.diagnostics.catalogue import CATALOGUE_METRICS, ORDER_METRICS, SPLIT_METRICS

    cfg, model, ids, am, rm = setup
    a, b = TrainKernels(model, "train", temperature=2.0), _gen(cfg, model)
    r = compare(a, b, ids, am, rm, advantages=torch.tensor([1.0, -1.0, 0.5]))
    assert set(CATALOGUE_METRICS) <= set(r.metrics) and set(ORDER_METRICS + SPLIT_METRICS) <= set(r.metrics)
    assert r.metrics["rollout_k2_kl"] > 0 and r.metrics["logprob_abs_diff_median"] > 0
    assert r.metrics["token_fraction_adv_pos"] > r.metrics["token_fraction_adv_neg"] > 0
    assert math.isnan(compare(a, b, ids, am, rm).metrics["token_mult_prob_error_adv_pos"])
