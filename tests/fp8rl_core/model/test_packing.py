"""Padding-free batches (fp8rl_core/model/packing.py): the layout of `pack`, and a padding-free forward of the
model equal to the padded one at every real token, whatever the padding layout."""
from __future__ import annotations

import pytest
import torch

from fp8rl_core.model import ModelConfig, build_model
from fp8rl_core.model.packing import pack

CFG = ModelConfig(vocab_size=32, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)


def test_pack_layout_right_left_and_holes():
    mask = torch.tensor([[1, 1, 1, 0, 0],   # right padding
                         [0, 0, 1, 1, 1],   # left padding
                         [1, 0, 1, 0, 1],   # holes
                         [0, 0, 0, 0, 0]],  # empty
                        dtype=torch.bool)
    p = pack(mask)
    assert p.num_tokens == 9 and (p.batch, p.length, p.max_len) == (4, 5, 3)
    assert p.index.tolist() == [0, 1, 2, 7, 8, 9, 10, 12, 14]
    assert p.positions.tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2]  # real tokens counted, per sequence
    assert p.slot.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8]  # row b of the grid [4, 3], from column 0
    x = torch.arange(20.0).view(4, 5)
    taken = p.take(x)
    assert taken.tolist() == [0, 1, 2, 7, 8, 9, 10, 12, 14]
    assert torch.equal(p.put(taken), torch.where(mask, x, torch.zeros_like(x)))
    grid = p.to_grid(taken)
    assert grid.tolist() == [[0, 1, 2], [7, 8, 9], [10, 12, 14], [0, 0, 0]]
    assert torch.equal(p.from_grid(grid), taken)


def test_pack_without_real_tokens_keeps_a_grid_column():
    p = pack(torch.zeros(2, 3, dtype=torch.bool))
    assert p.num_tokens == 0 and p.max_len == 1


@pytest.mark.parametrize("layout", ["right", "left", "holes"])
def test_padding_free_logits_equal_padded_logits_at_real_tokens(layout):
    """FP32, no autocast: every token-wise op is row-wise and attention sees the same keys, so the logits of
    the real tokens agree to FP32 rounding (GEMM blocking may depend on the row count): |diff| <= 1e-5, with
    logits of size ~1 (measured: bitwise equal on this CPU)."""
    torch.manual_seed(0)
    model = build_model(CFG)
    B, T = 5, 11
    lengths = torch.tensor([11, 7, 3, 9, 1])
    pos = torch.arange(T)
    if layout == "right":
        mask = pos[None] < lengths[:, None]
    elif layout == "left":
        mask = pos[None] >= T - lengths[:, None]
    else:
        mask = (pos[None] < lengths[:, None]) & ((pos[None] % 3 != 1) | (pos[None] == 0))
    ids = torch.randint(3, CFG.vocab_size, (B, T))
    with torch.no_grad():
        padded = model(ids, mask)
        p = pack(mask)
        packed = model(p.take(ids)[None], packed=p)
    assert packed.shape == (1, p.num_tokens, CFG.vocab_size)
    assert float((packed[0] - p.take(padded)).abs().max()) <= 1e-5


def test_packed_forward_refuses_a_padded_batch():
    model = build_model(CFG)
    mask = torch.ones(2, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="real tokens as \\[1, N\\]"):
        model(torch.ones(2, 4, dtype=torch.long), packed=pack(mask))
