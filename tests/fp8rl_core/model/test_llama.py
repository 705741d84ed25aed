"""The model itself: names, padding, init, BF16 autocast; transformers is the peer where it has one.

Error norm: relative max-norm, max|ours - ref| / max|ref|.
"""
from __future__ import annotations

import pytest
import torch
import transformers

from fp8rl_core.model import ModelConfig, build_model
from fp8rl_core.model.llama import positions_and_mask

CFG = dict(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=64)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def pair(attention_bias: bool = False):
    """Our random model and a transformers Llama holding the same weights."""
    torch.manual_seed(0)
    ours = build_model(ModelConfig(**CFG, attention_bias=attention_bias)).eval()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "norm" in name else 0.02))
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG, attention_bias=attention_bias)).eval()
    ref.load_state_dict(ours.state_dict(), strict=True)
    return ours, ref


@pytest.mark.parametrize("attention_bias", [False, True])
def test_state_dict_names_equal_hf(attention_bias):
    ours, ref = pair(attention_bias)
    assert list(ours.state_dict()) == list(ref.state_dict())
    assert (ours.model.layers[0].self_attn.o_proj.bias is not None) == attention_bias  # HF Llama: o_proj too
    x = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        assert rel_err(ours(x), ref(x).logits) <= 1e-5


def test_right_padding_leaves_real_tokens_unchanged():
    ours, _ = pair()
    x = torch.randint(0, 64, (3, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(3, 10, dtype=torch.bool)
    mask[1, 6:] = False
    mask[2, 3:] = False
    with torch.no_grad():
        padded = ours(x, mask)
        for row, n in ((0, 10), (1, 6), (2, 3)):
            alone = ours(x[row:row + 1, :n])
            assert rel_err(padded[row, :n], alone[0]) <= 1e-6


def test_left_padding_matches_hf_with_positions():
    ours, ref = pair()
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :3] = 0
    positions, sdpa_mask = positions_and_mask(x, mask)
    assert positions[0].tolist() == [0, 0, 0, 0, 1, 2, 3, 4] and sdpa_mask is not None
    with torch.no_grad():
        mine = ours(x, mask)
        theirs = ref(x, attention_mask=mask, position_ids=positions).logits
        alone = ours(x[:1, 3:])
    assert torch.isfinite(mine).all()  # pad queries attend to themselves: no NaN rows
    assert rel_err(mine[:, 3:], theirs[:, 3:]) <= 1e-5
    assert rel_err(mine[0, 3:], alone[0]) <= 1e-5


def test_build_model_is_seeded_and_hf_initialised():
    cfg = ModelConfig(**CFG)
    torch.manual_seed(5)
    a = build_model(cfg)
    torch.manual_seed(5)
    b = build_model(cfg)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    w = a.model.layers[0].mlp.up_proj.weight.detach()
    assert abs(float(w.std()) - 0.02) < 0.002 and abs(float(w.mean())) < 0.002
    assert torch.equal(a.model.norm.weight, torch.ones(CFG["hidden_size"]))
    assert build_model(cfg, dtype=torch.bfloat16).lm_head.weight.dtype == torch.bfloat16


def test_bf16_autocast_close_to_fp32():
    ours, _ = pair()
    x = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        ref = ours(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = ours(x)
    assert low.dtype == torch.bfloat16
    err = rel_err(low.float(), ref)
    assert 0 < err < 0.05, f"BF16 autocast relative error {err:.3e}"


def test_unknown_model_type_is_rejected():
    with pytest.raises(ValueError, match="model_type"):
        build_model(ModelConfig(**CFG, model_type="mistral"))
