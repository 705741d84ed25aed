"""Fp8Linear quantizes its weight once per weight value (per optimizer step), with unchanged bits."""
from __future__ import annotations

import torch

from fp8rl_core.fp8 import Fp8Linear
from fp8rl_core.fp8 import linear as linear_mod


def count_weight_quantizations(monkeypatch) -> list[int]:
    calls = [0]
    real = linear_mod.quantize_weight

    def counting(*a, **kw):
        calls[0] += 1
        return real(*a, **kw)

    monkeypatch.setattr(linear_mod, "quantize_weight", counting)
    return calls


def train(layer: Fp8Linear, steps: int, seed: int = 0) -> list[torch.Tensor]:
    """A no-grad pass, two micro-batches of forward+backward and an AdamW step, `steps` times;
    returns every output and gradient."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    seen = []
    for _ in range(steps):
        with torch.no_grad():
            seen.append(layer(torch.randn(5, 256, generator=g).bfloat16()))
        for _ in range(2):
            x = torch.randn(3, 7, 256, generator=g).bfloat16().requires_grad_()
            y = layer(x)
            y.float().square().sum().backward()
            seen += [y.detach(), x.grad]
        seen += [layer.weight.grad.clone(), layer.bias.grad.clone()]
        opt.step()
        opt.zero_grad(set_to_none=True)
    return seen


def fresh_layer() -> Fp8Linear:
    torch.manual_seed(0)
    return Fp8Linear(256, 384)


def test_one_quantization_per_optimizer_step(monkeypatch):
    calls = count_weight_quantizations(monkeypatch)
    train(fresh_layer(), steps=3)
    assert calls[0] == 3  # not 3 x (1 no-grad pass + 2 micro-batches)


def test_same_bits_as_without_the_cache(monkeypatch):
    cached = train(fresh_layer(), steps=3)
    monkeypatch.setenv("FP8RL_WEIGHT_CACHE", "0")
    calls = count_weight_quantizations(monkeypatch)
    plain = train(fresh_layer(), steps=3)
    assert calls[0] == 9  # off: once per forward
    assert len(cached) == len(plain)
    assert all(torch.equal(a, b) for a, b in zip(cached, plain))


def test_in_place_writes_without_an_optimizer_invalidate_it():
    layer = fresh_layer()
    x = torch.randn(4, 256)
    with torch.no_grad():
        before = layer(x)
        layer.weight.mul_(2.0)  # bumps the version counter
        after = layer(x)
        other = fresh_layer()
        other.load_state_dict(layer.state_dict())  # copy_ into other's parameters
        assert torch.equal(other(x), after)
        layer.load_state_dict(fresh_layer().state_dict())
        assert torch.equal(layer(x), before)
        layer.weight = torch.nn.Parameter(layer.weight * 2.0)  # a new tensor
        assert torch.equal(layer(x), after)
