"""Checkpoints: atomic (a crash mid-write leaves the previous one), safe to load, pruned."""
import random

import pytest

import torch

from fp8rl_core import checkpoint as ck


def _state():
    return {"step": 3, "rng": random.Random(1).getstate(), "opt": {"exp_avg": torch.ones(3)}, "gen": torch.get_rng_state()}


def test_roundtrip_and_weights_only(tmp_path):
    w = {"a.weight": torch.randn(4, 4), "b": torch.arange(3)}
    path = ck.save_checkpoint(tmp_path, 3, w, _state(), meta={"cell_id": "x"})
    weights, state, meta = ck.load_checkpoint(path)
    assert torch.equal(weights["a.weight"], w["a.weight"]) and torch.equal(weights["b"], w["b"])
    assert meta == {"step": 3, "cell_id": "x"} and state["step"] == 3
    r = random.Random()
    r.setstate(tuple(tuple(x) if isinstance(x, (list, tuple)) else x for x in state["rng"]))
    assert r.random() == random.Random(1).random()


def test_half_written_checkpoint_is_invisible(tmp_path, monkeypatch):
    ck.save_checkpoint(tmp_path, 1, {"w": torch.zeros(2)}, {"step": 1})

    def boom(*a, **k):
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(ck.torch, "save", boom)
    with pytest.raises(KeyboardInterrupt):
        ck.save_checkpoint(tmp_path, 2, {"w": torch.ones(2)}, {"step": 2})
    latest = ck.latest_checkpoint(tmp_path)
    assert latest.name == "step_00000001"
    assert torch.equal(ck.load_checkpoint(latest)[0]["w"], torch.zeros(2))


def test_keeps_newest(tmp_path):
    for s in range(1, 5):
        ck.save_checkpoint(tmp_path, s, {"w": torch.full((1,), float(s))}, {"step": s}, keep=2)
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]
    ck.save_checkpoint(tmp_path, 4, {"w": torch.full((1,), 9.0)}, {"step": 4}, keep=2)  # same step again
    assert float(ck.load_checkpoint(ck.latest_checkpoint(tmp_path))[0]["w"]) == 9.0
