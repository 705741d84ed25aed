"""The study's premise on the native engines: their kernels differ the way vLLM's and Megatron's do.

Same weights, same sampled tokens: the training engine re-scores what the generation engine sampled.
BF16 must show a small but real mismatch (> 1: the engines are not the same code), FP8 end to end
more, and FP8 generation against BF16 training the most (docs/design.md, the seed's Figure 1 ordering).
"""
import pytest
import torch

from fp8rl_core.builder import build_generation_engine, build_training_engine, load_tokenizer
from fp8rl_core.config import load_run_config
from fp8rl_core.engines.base import SamplingParams
from fp8rl_core.metrics import token_mult_prob_error
from fp8rl_core.model.config import ModelConfig
from fp8rl_core.rollout import build_train_batch
from fp8rl_core.tasks import make_task
from fp8rl_core.warmstart import warm_start


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    cfg = load_run_config(None, [f"warmstart.cache_dir={tmp_path_factory.mktemp('ws')}", "warmstart.steps=40",
                                 "warmstart.batch_size=32", "task.val_size=8", "task.digits=2"])
    torch.set_num_threads(1)
    tok, task = load_tokenizer(cfg), make_task(cfg.task)
    return cfg, tok, task, warm_start(cfg, tok, task, progress=False)


def _mismatch(warm, recipe: str) -> float:
    cfg, tok, task, path = warm
    cfg = load_run_config(None, [f"recipe={recipe}", "device=cpu", "rollout.temperature=1.0"])  # = SamplingParams
    import json

    mc = ModelConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
    train = build_training_engine(cfg, path, "cpu")
    gen = build_generation_engine(cfg, mc, "cpu")
    gen.refit(train.weights())
    prompts = [tok.encode(ex.prompt) for ex in task.sample_train(7, 96)]
    out = gen.generate(prompts, SamplingParams(max_new_tokens=6, seed=3))
    batch = build_train_batch(prompts, out, tok.pad_id)
    return token_mult_prob_error(train.logprobs(batch), batch.gen_logprobs, batch.response_mask)


@pytest.mark.slow
def test_mismatch_ordering_bf16_lt_fp8e2e_lt_fp8gen(warm):
    m = {r: _mismatch(warm, r) for r in ("bf16", "fp8_e2e", "fp8_gen")}
    print("token_mult_prob_error:", m)
    assert 1.0 < m["bf16"] < m["fp8_e2e"] < m["fp8_gen"], m
