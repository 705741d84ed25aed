"""Each low-precision knob (issue 23) reaches the engines it applies to and changes what they compute: an
engine that ignored a knob would score a fixed batch exactly as under the default recipe. End to end,
each knob runs a tiny GRPO cell through `run` (the path a sweep cell takes)."""
from __future__ import annotations

import copy

import pytest
import torch

from fp8rl_core.config import Fp8Spec, load_run_config, resolve_recipe
from fp8rl_core.engines.base import SamplingParams
from fp8rl_core.engines.native_gen import NativeGenerationEngine
from fp8rl_core.engines.native_train import NativeTrainingEngine
from fp8rl_core.loop.rollout import build_train_batch
from fp8rl_core.loop.run import run
from fp8rl_core.model import ModelConfig, build_model

CFG = ModelConfig(vocab_size=48, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
# knob -> Fp8Spec values; every knob applies to both engines of fp8_e2e
KNOBS = {
    "fp8.format=tensorwise": {"format": "tensorwise"},
    "fp8.format=mxfp8": {"format": "mxfp8"},
    "fp8.format=nvfp4": {"format": "nvfp4"},
    "fp8.scale_format=pow2": {"scale_format": "pow2"},
    "fp8.quantize_from=master": {"quantize_from": "master"},
    "fp8.lm_head=fp8": {"lm_head": "fp8"},
    "fp8.bf16_last_layers=1": {"bf16_last_layers": 1},
}
TEMP = 1.0


@pytest.fixture(scope="module")
def setup():
    """A model whose weights are not BF16-exact (so that master vs bf16 sourcing differs), a fixed batch
    sampled once by the default engine, and the default recipe's scores of it."""
    torch.manual_seed(0)
    model = build_model(CFG)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)  # off the BF16 grid
    prompts = [[1 + (i * 7 + j) % 40 for j in range(5 + i % 3)] for i in range(6)]
    gen = _gen(model, resolve_recipe("fp8_e2e", Fp8Spec()))
    out = gen.generate(prompts, SamplingParams(max_new_tokens=6, temperature=TEMP))
    batch = build_train_batch(prompts, out, CFG.pad_id)
    default = _scores(model, resolve_recipe("fp8_e2e", Fp8Spec()), prompts, out, batch)
    return model, prompts, out, batch, default


def _gen(model, recipe) -> NativeGenerationEngine:
    gen = NativeGenerationEngine(CFG, recipe=recipe, dtype=torch.bfloat16, seed=0)
    gen.refit(model.state_dict())
    return gen


def _scores(model, recipe, prompts, out, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(generation engine's log-probs of `out`, trainer's log-probs of `batch`) under `recipe`."""
    gen = _gen(model, recipe).score(prompts, out, TEMP)
    train = NativeTrainingEngine(copy.deepcopy(model), recipe=recipe, temperature=TEMP,
                                 compute_dtype=torch.bfloat16).logprobs(batch)
    return gen, train


@pytest.mark.parametrize("knob", list(KNOBS))
def test_each_knob_changes_both_engines(setup, knob):
    model, prompts, out, batch, (gen0, train0) = setup
    gen, train = _scores(model, resolve_recipe("fp8_e2e", Fp8Spec(**KNOBS[knob])), prompts, out, batch)
    mask = out.response_mask
    assert not torch.equal(gen[mask], gen0[mask]), f"{knob}: the generation engine ignored it"
    assert not torch.equal(train[batch.response_mask], train0[batch.response_mask]), f"{knob}: the trainer ignored it"
    # still the same policy: quantization noise, not another model
    assert float((gen - gen0)[mask].abs().max()) < 2.0 and float((train - train0).abs().max()) < 2.0


def test_fp8_gen_knobs_leave_the_bf16_trainer_alone(setup):
    model, prompts, out, batch, _ = setup
    base = resolve_recipe("fp8_gen", Fp8Spec())
    _, train0 = _scores(model, base, prompts, out, batch)
    for knob, values in KNOBS.items():
        if knob.startswith("fp8.bf16_"):
            continue  # the layer counts are the recipe's, the BF16 trainer has no FP8 layer to keep
        _, train = _scores(model, resolve_recipe("fp8_gen", Fp8Spec(**values)), prompts, out, batch)
        assert torch.equal(train, train0), knob


@pytest.mark.slow
@pytest.mark.parametrize("knob", list(KNOBS))
def test_each_knob_runs_a_cell_end_to_end(tmp_path, knob):
    cfg = load_run_config(None, [
        "recipe=fp8_e2e", knob, f"output_dir={tmp_path / 'run'}", f"warmstart.cache_dir={tmp_path / 'ws'}",
        "warmstart.steps=5", "warmstart.batch_size=8", "train.steps=2", "train.val_every=2",
        "train.checkpoint_every=2", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
        "rollout.max_new_tokens=4", "task.val_size=4", "threads=1", "tracking.uri=null"])
    last = run(cfg, progress=False)
    assert last["token_mult_prob_error"] == last["token_mult_prob_error"]  # finite, logged
    assert (tmp_path / "run" / "checkpoints").exists()
