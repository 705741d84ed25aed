"""parallel.mixed_precision (issue 31, M6): FSDP2's MixedPrecisionPolicy on real gloo ranks. bf16 gathers BF16
parameters and keeps FP32 shards (the masters, the optimizer, checkpoints); the forward's numbers are the
default's bit for bit (autocast already computed on the BF16 rounding of the masters, and RMSNorm takes
its statistics in FP32 from x); none (the default) gathers FP32, as before."""
from __future__ import annotations

import pytest
import torch
from _mp_workers import gathered_dtypes_and_logprobs
from _ranks import run_ranks

from fp8rl_core.config import load_run_config
from fp8rl_core.config.run_config import run_config_hash
from fp8rl_core.config.schema import ConfigError
from fp8rl_core.distributed.memory_plan import plan_for_run
from fp8rl_core.model.layers import RMSNorm


@pytest.mark.slow
def test_bf16_gathers_bf16_keeps_fp32_shards_and_computes_the_same_forward():
    none = run_ranks(2, gathered_dtypes_and_logprobs, "none")
    bf16 = run_ranks(2, gathered_dtypes_and_logprobs, "bf16")
    assert none[0]["gathered"] == ["torch.float32"]  # the default all-gathers the FP32 masters
    assert bf16[0]["gathered"] == ["torch.bfloat16"]
    assert bf16[0]["shards"] == none[0]["shards"] == ["torch.float32"]
    for r in range(2):
        assert torch.equal(bf16[r]["old_logprobs"], none[r]["old_logprobs"])


def test_rmsnorm_takes_fp32_statistics_whatever_its_weights_dtype():
    """What a BF16-gathered norm needs: the same output from a BF16 weight as from its FP32 master."""
    torch.manual_seed(0)
    fp32 = RMSNorm(256, 1e-5)
    with torch.no_grad():
        fp32.weight.uniform_(0.5, 1.5)
    bf16 = RMSNorm(256, 1e-5)
    bf16.weight = torch.nn.Parameter(fp32.weight.detach().to(torch.bfloat16))
    x = (torch.randn(4, 256) * 30).to(torch.bfloat16)  # large values: BF16 statistics would differ
    assert torch.equal(bf16(x), fp32(x))


def test_the_knob_is_validated_at_the_edge_and_enters_the_cell_id_only_when_set():
    base = load_run_config(None, [])
    assert run_config_hash(load_run_config(None, ["parallel.mixed_precision=none"])) == run_config_hash(base)
    assert run_config_hash(load_run_config(None, ["parallel.mixed_precision=bf16"])) != run_config_hash(base)
    with pytest.raises(ConfigError, match="parallel.mixed_precision.*none, bf16"):
        load_run_config(None, ["parallel.mixed_precision=fp16"])
    with pytest.raises(ConfigError, match="parallel.mixed_precision.*model.dtype fp32"):
        load_run_config(None, ["parallel.mixed_precision=bf16", "model.dtype=fp32"])
    with pytest.raises(ConfigError, match="parallel.mixed_precision.*quantize_from master"):
        load_run_config(None, ["parallel.mixed_precision=bf16", "recipe=fp8_e2e", "fp8.quantize_from=master"])


def test_the_plan_counts_bf16_gathered_blocks():
    cfg = load_run_config(None, ["model.preset=tiny", "parallel.reshard_after_forward=false"])
    mp = load_run_config(None, ["model.preset=tiny", "parallel.reshard_after_forward=false",
                                "parallel.mixed_precision=bf16"])
    a, b = plan_for_run(cfg, world_size=2).phases["training"], plan_for_run(mp, world_size=2).phases["training"]
    assert b["fsdp_kept_gathered"] * 2 == a["fsdp_kept_gathered"] and b["fsdp_unsharded"] < a["fsdp_unsharded"]
