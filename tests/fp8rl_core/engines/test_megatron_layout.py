"""The Megatron engine's layout and FP8 padding on a CPU (Megatron-Core's real GPTModel, local spec;
fixtures from test_megatron_train): it refuses layouts it does not run instead of training ranks apart,
pads batches for Transformer Engine's FP8 GEMMs without changing a real token's logits, and stages
checkpoints on the host."""
from __future__ import annotations

import pytest
import torch
from _train_batches import make_batch
from test_megatron_train import LLAMA, _engines, cpu_gpt, megatron_cpu, random_model  # noqa: F401 (fixture)

from fp8rl_core.config import MegatronSpec
from fp8rl_core.engines.megatron_convert import hf_to_megatron, load_megatron_state
from fp8rl_core.engines.megatron_train import GPTAsCausalLM, check_layout

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron.*")


def test_layouts_the_engine_does_not_run_are_refused_with_what_is_missing():
    assert check_layout(MegatronSpec(), 1, LLAMA) == (1, 1, 1)
    with pytest.raises(RuntimeError, match=r"data parallelism \(8 replicas\): Megatron's DistributedDataParallel"):
        check_layout(MegatronSpec(), 8, LLAMA)
    with pytest.raises(RuntimeError, match=r"tensor parallelism \(2\).*Valid: one rank per cell"):
        check_layout(MegatronSpec(tensor_parallel_size=2), 2, LLAMA)
    with pytest.raises(RuntimeError, match=r"pipeline parallelism \(2\)"):
        check_layout(MegatronSpec(pipeline_parallel_size=2), 2, LLAMA)


def test_fp8_padding_leaves_real_token_logits_unchanged(megatron_cpu):  # noqa: F811 (the imported fixture)
    ours = random_model(LLAMA)
    gpt = cpu_gpt(LLAMA)
    load_megatron_state(gpt, hf_to_megatron(ours.state_dict(), LLAMA))
    batch = make_batch(LLAMA.vocab_size)
    b, t = batch.input_ids.shape
    with torch.no_grad():
        plain = GPTAsCausalLM(gpt, 1)(batch.input_ids, batch.attention_mask)
        padded = GPTAsCausalLM(gpt, 128)(batch.input_ids, batch.attention_mask)
    assert padded.shape == plain.shape == (b, t, LLAMA.vocab_size) and (b * t) % 128 != 0
    real = batch.attention_mask.bool()
    assert float((padded[real] - plain[real]).abs().max()) <= 1e-5 * float(plain.abs().max())


def test_fp8_recipe_pads_and_checkpoints_are_host_copies(megatron_cpu):  # noqa: F811
    _, mega = _engines(LLAMA, "fp32", recipe="fp8_e2e", engines={"training": "megatron",
                                                                  "megatron": {"pad_tokens_to": 64}})
    assert mega.inner.model.pad_to == 64
    mega.train_step(make_batch(LLAMA.vocab_size))
    state = mega.state_dict()
    live = {p.data_ptr() for p in mega.gpt.parameters()}
    tensors = list(state["model"].values()) + [v for s in state["optimizer"]["state"].values()
                                               for v in s.values() if torch.is_tensor(v)]
    assert all(t.device.type == "cpu" and t.data_ptr() not in live for t in tensors)
    _, bf16 = _engines(LLAMA, "fp32")
    assert bf16.inner.model.pad_to == 1  # BF16 training: no padding
