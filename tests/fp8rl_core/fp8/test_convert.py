"""convert_linear_layers: in-place swap with shared Parameters and fnmatch exclusions."""
from __future__ import annotations

import torch
from torch import nn

from fp8rl_core.fp8 import Fp8Linear, Quantization, convert_linear_layers


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(128, 128)
        self.up = nn.Linear(128, 256, bias=False)
        self.norm = nn.LayerNorm(128)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 128)
        self.layers = nn.ModuleList([Block() for _ in range(3)])
        self.lm_head = nn.Linear(128, 10, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for blk in self.layers:
            h = blk.norm(h + blk.up(blk.q_proj(h))[..., :128])
        return self.lm_head(h)


def test_converts_all_but_excluded_and_shares_parameters():
    torch.manual_seed(0)
    model = Tiny()
    params_before = {n: p for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    names = convert_linear_layers(model, exclude=("lm_head", "layers.2.*"),
                                  quant=Quantization(scale_format="pow2"))
    assert names == ["layers.0.q_proj", "layers.0.up", "layers.1.q_proj", "layers.1.up"]
    for name, mod in model.named_modules():
        if name in names:
            assert isinstance(mod, Fp8Linear) and mod.power_of_two
        elif isinstance(mod, nn.Linear):
            assert type(mod) is nn.Linear, name
    assert {n: p for n, p in model.named_parameters()} == params_before  # the very same Parameter objects
    w_before = model.layers[0].q_proj.weight.detach().clone()
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    opt.step()  # the optimizer built before the swap still updates the converted layers
    assert not torch.equal(model.layers[0].q_proj.weight, w_before)


def test_second_call_converts_nothing_and_keeps_state_dict_keys():
    model = Tiny()
    keys = list(model.state_dict())
    assert len(convert_linear_layers(model, exclude=())) == 7
    assert convert_linear_layers(model) == []
    assert list(model.state_dict()) == keys
