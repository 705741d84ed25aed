"""engines.megatron: the parallel knobs mapped onto Megatron-Core's constructors (checked against the
real classes, which build on a CPU), and tensor-parallel shards of the converted weights checked against
an independent reference: each rank's shard must equal the *unsharded* conversion of the HF weights
that rank owns (its heads / kv groups, its slice of the MLP and vocabulary) under the per-rank config."""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from test_megatron_convert import LLAMA, QWEN2, random_hf_state

from fp8rl_core.config import MegatronSpec, OptimSpec, load_run_config
from fp8rl_core.config.schema import ConfigError
from fp8rl_core.engines import megatron_parallel as mp
from fp8rl_core.engines.megatron_convert import hf_to_megatron, megatron_to_hf
from fp8rl_core.model import ModelConfig


def rank_hf_state(state: dict, cfg: ModelConfig, tp: int, r: int) -> tuple[dict, ModelConfig]:
    """The HF tensors TP rank r owns (written from the HF layout by head index), and the per-rank config."""
    n, g, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    heads = slice(r * n // tp * d, (r + 1) * n // tp * d)
    groups = slice(r * g // tp * d, (r + 1) * g // tp * d)
    inter = slice(r * cfg.intermediate_size // tp, (r + 1) * cfg.intermediate_size // tp)
    vocab = slice(r * cfg.vocab_size // tp, (r + 1) * cfg.vocab_size // tp)
    out = {}
    for key, t in state.items():
        if key.endswith(("q_proj.weight", "q_proj.bias")):
            out[key] = t[heads]
        elif key.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
            out[key] = t[groups]
        elif key.endswith("o_proj.weight"):
            out[key] = t[:, heads]
        elif key.endswith(("gate_proj.weight", "up_proj.weight")):
            out[key] = t[inter]
        elif key.endswith("down_proj.weight"):
            out[key] = t[:, inter]
        elif key.endswith(("embed_tokens.weight", "lm_head.weight")):
            out[key] = t[vocab]
        else:
            out[key] = t
    small = dataclasses.replace(cfg, num_attention_heads=n // tp, num_key_value_heads=g // tp,
                                intermediate_size=cfg.intermediate_size // tp, vocab_size=cfg.vocab_size // tp)
    return out, small


@pytest.mark.parametrize("cfg, tp", [(LLAMA, 2), (QWEN2, 2)], ids=["llama-tp2", "qwen2-bias-tied-tp2"])
@pytest.mark.parametrize("te", [False, True], ids=["local", "te"])
def test_tp_shards_equal_the_unsharded_conversion_of_each_ranks_weights(cfg, tp, te):
    state = random_hf_state(cfg)
    full = hf_to_megatron(state, cfg, te_fused_norms=te)
    shards = [mp.shard_megatron_state(full, cfg, tp, r) for r in range(tp)]
    for r, shard in enumerate(shards):
        own, small = rank_hf_state(state, cfg, tp, r)
        want = hf_to_megatron(own, small, te_fused_norms=te)
        assert shard.keys() == want.keys()
        for key in want:
            assert torch.equal(shard[key], want[key]), key
    back = mp.gather_megatron_state(shards)
    assert all(torch.equal(back[k], full[k]) for k in full)
    hf = megatron_to_hf(back, cfg)
    assert all(torch.equal(hf[k], state[k]) for k in state)


def test_sharding_refuses_what_does_not_divide():
    with pytest.raises(ValueError, match="tensor_parallel_size=4: the model's num_key_value_heads \\(2\\)"):
        mp.shard_megatron_state({}, LLAMA, 4, 0)
    with pytest.raises(ValueError, match="does not divide the world size 6"):
        mp.parallel_sizes(MegatronSpec(tensor_parallel_size=4), 6)
    with pytest.raises(ValueError, match="pipeline_parallel_size=3: 2 layers"):
        mp.parallel_sizes(MegatronSpec(pipeline_parallel_size=3), 3, LLAMA)
    assert mp.parallel_sizes(MegatronSpec(tensor_parallel_size=2, pipeline_parallel_size=2), 8, LLAMA) == (2, 2, 2)
    tp_only = {k: v for k, v in hf_to_megatron(random_hf_state(LLAMA), LLAMA).items()}
    shard = mp.shard_megatron_state(tp_only, LLAMA, 2, 0)
    shard["decoder.final_layernorm.weight"] = shard["decoder.final_layernorm.weight"] + 1
    with pytest.raises(ValueError, match="replicated tensor differs"):
        mp.gather_megatron_state([shard, mp.shard_megatron_state(tp_only, LLAMA, 2, 1)])


def test_run_config_megatron_section():
    cfg = load_run_config(None, ["engines.megatron.tensor_parallel_size=2", "engines.megatron.sequence_parallel=true"])
    assert cfg.engines.megatron.tensor_parallel_size == 2 and cfg.engines.megatron.distributed_optimizer
    with pytest.raises(ConfigError, match="engines.megatron.sequence_parallel: needs tensor_parallel_size > 1"):
        load_run_config(None, ["engines.megatron.sequence_parallel=true"])
    with pytest.raises(ConfigError, match="engines.megatron.pipeline_parallel_size: must be >= 1"):
        load_run_config(None, ["engines.megatron.pipeline_parallel_size=0"])


def test_every_knob_maps_onto_megatrons_constructors():
    pytest.importorskip("megatron.core")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.transformer.transformer_config import TransformerConfig
    import inspect

    spec = MegatronSpec(tensor_parallel_size=2, pipeline_parallel_size=2, sequence_parallel=True,
                        distributed_optimizer=True)
    kw = mp.model_parallel_kwargs(spec)
    assert kw == {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}
    assert set(kw) <= set(inspect.signature(parallel_state.initialize_model_parallel).parameters)
    ddp = DistributedDataParallelConfig(**mp.ddp_config_kwargs(spec))
    assert ddp.use_distributed_optimizer and ddp.grad_reduce_in_fp32 and not ddp.overlap_grad_reduce
    optim = OptimSpec(lr=3e-7, weight_decay=0.01, betas=[0.9, 0.95], eps=1e-8, grad_clip=1.0)
    oc = OptimizerConfig(**mp.optimizer_config_kwargs(optim, spec))
    assert (oc.optimizer, oc.lr, oc.weight_decay, oc.adam_beta1, oc.adam_beta2, oc.adam_eps, oc.clip_grad) == \
        ("adam", 3e-7, 0.01, 0.9, 0.95, 1e-8, 1.0)
    assert oc.bf16 and oc.params_dtype == torch.bfloat16 and oc.use_distributed_optimizer
    tc = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, **mp.transformer_parallel_kwargs(spec))
    assert (tc.tensor_model_parallel_size, tc.pipeline_model_parallel_size, tc.sequence_parallel) == (2, 2, True)
    no_clip, no_dist = OptimSpec(grad_clip=0.0), MegatronSpec(distributed_optimizer=False)
    plain = OptimizerConfig(**mp.optimizer_config_kwargs(no_clip, no_dist))
    assert plain.clip_grad == 0.0 and not plain.use_distributed_optimizer


@pytest.mark.parametrize("b, t, m, want", [(4, 10, 128, 32), (3, 10, 128, 128), (64, 7, 128, 8), (5, 9, 1, 9),
                                           (8, 16, 16, 16)])
def test_padded_length_makes_tokens_a_multiple(b, t, m, want):
    got = mp.padded_length(b, t, m)
    assert got == want and got >= t and (b * got) % m == 0
