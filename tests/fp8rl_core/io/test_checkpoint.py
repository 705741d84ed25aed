"""Checkpoints (one process): DCP round trip of model + AdamW, atomic (a crash mid-write leaves the
previous one), safe to load (no code runs from a crafted file), pruned, exportable to HF."""
import json
import os
import pickle
import random
from types import SimpleNamespace

import pytest
import torch

from fp8rl_core.io import checkpoint as ck
from fp8rl_core.model import build_model, load_pretrained, preset


def _engine(seed: int, steps: int = 0) -> SimpleNamespace:
    """A tiny CausalLM + AdamW, trained `steps` steps on fixed data: what EngineState sees of an engine."""
    torch.manual_seed(seed)
    model = build_model(preset("tiny", num_hidden_layers=2, hidden_size=256, intermediate_size=256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    eng = SimpleNamespace(model=model, optimizer=opt, step=0)
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(7))
    for _ in range(steps):
        model(ids).float().logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
        eng.step += 1
    return eng


def _save(root, step, eng, rank_state=None, **kw):
    return ck.save_checkpoint(root, step, {ck.TRAIN_KEY: ck.EngineState(eng)}, rank_state or {"step": step},
                              model_config=eng.model.config.to_hf_dict(), **kw)


def _same(a: SimpleNamespace, b: SimpleNamespace) -> bool:
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    model = all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values()))
    optim = sa["state"].keys() == sb["state"].keys() and all(
        torch.equal(sa["state"][i][k], sb["state"][i][k]) for i in sa["state"] for k in sa["state"][i])
    return model and optim and sa["param_groups"] == sb["param_groups"] and a.step == b.step


def test_roundtrip_model_optimizer_and_rank_state(tmp_path):
    src = _engine(0, steps=2)
    rng = random.Random(1)
    path = _save(tmp_path, 3, src, {"step": 3, "rng": rng.getstate(), "gen": torch.get_rng_state()},
                 meta={"cell_id": "x"})
    dst = _engine(1)  # other weights, an optimizer that never stepped
    assert not _same(src, dst)
    meta = ck.load_checkpoint(path, {ck.TRAIN_KEY: ck.EngineState(dst)})
    assert _same(src, dst)
    assert meta == {"step": 3, "format": ck.FORMAT, "world_size": 1, "cell_id": "x"}
    state = ck.read_rank_state(path)
    r = random.Random()
    r.setstate(tuple(tuple(x) if isinstance(x, (list, tuple)) else x for x in state["rng"]))
    assert r.random() == random.Random(1).random()
    assert ck.read_rank_state(path, rank=1) is None  # written by one rank


def test_model_is_stored_once(tmp_path):
    eng = _engine(0, steps=1)
    path = _save(tmp_path, 1, eng)
    n_params = sum(p.numel() for p in eng.model.parameters())
    on_disk = sum(f.stat().st_size for f in path.iterdir())
    # FP32 weights + exp_avg + exp_avg_sq = 12 B/param; a second copy of the weights would make it 16
    assert 12 * n_params <= on_disk < 13 * n_params
    assert not (path / "weights.safetensors").exists() and not (path / "state.pt").exists()


@pytest.mark.parametrize("where", ["dcp", "rank_state", "seal"])
def test_kill_mid_save_leaves_previous_checkpoint(tmp_path, monkeypatch, where):
    first = _engine(0, steps=1)
    _save(tmp_path, 1, first)

    def boom(*a, **k):
        raise KeyboardInterrupt("killed mid-write")

    if where == "dcp":  # after the first tensor file is written
        real_save = torch.save
        monkeypatch.setattr(ck.dcp, "save", lambda state, checkpoint_id, **k: (
            os.makedirs(checkpoint_id, exist_ok=True), real_save({}, os.path.join(checkpoint_id, "__0_0.distcp")),
            boom()))
    elif where == "rank_state":  # the shards are all on disk, the rank file half written
        monkeypatch.setattr(ck, "_write_rank_state", lambda folder, state: (
            (folder / "rank_00000.pt").write_bytes(b"PK\x03"), boom()))
    else:  # everything written, killed just before the rename
        monkeypatch.setattr(ck, "fsync_dir", boom)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 2, _engine(0, steps=2))
    monkeypatch.undo()
    latest = ck.latest_checkpoint(tmp_path)
    assert latest.name == "step_00000001" and [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_00000001"]
    back = _engine(5)
    ck.load_checkpoint(latest, {ck.TRAIN_KEY: ck.EngineState(back)})
    assert _same(first, back)
    _save(tmp_path, 2, _engine(0, steps=2))  # the stale temporary folder does not block the next save
    assert ck.latest_checkpoint(tmp_path).name == "step_00000002"
    assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())


def test_keeps_newest_and_replaces_same_step(tmp_path):
    for s in range(1, 5):
        _save(tmp_path, s, _engine(0, steps=s), keep=2)
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]
    again = _engine(0, steps=1)
    _save(tmp_path, 4, again, keep=2)  # same step again (a requeue): the new one wins
    back = _engine(5)
    ck.load_checkpoint(ck.latest_checkpoint(tmp_path), {ck.TRAIN_KEY: ck.EngineState(back)})
    assert _same(again, back)


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_crafted_metadata_cannot_run_code(tmp_path, monkeypatch):
    path = _save(tmp_path, 1, _engine(0, steps=1))
    (path / ".metadata").write_bytes(pickle.dumps(_Evil()))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(pickle.UnpicklingError, match="posix.system|os.system"):
        ck.load_checkpoint(path, {ck.TRAIN_KEY: ck.EngineState(_engine(1))})
    assert not (tmp_path / "pwned").exists()


def test_crafted_rank_state_cannot_run_code(tmp_path, monkeypatch):
    path = _save(tmp_path, 1, _engine(0, steps=1))
    (path / "rank_00000.pt").write_bytes(pickle.dumps(_Evil()))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(pickle.UnpicklingError):
        ck.read_rank_state(path)
    assert not (tmp_path / "pwned").exists()


def test_legacy_checkpoint_is_named_clearly(tmp_path):
    from safetensors.torch import save_file

    old = tmp_path / "step_00000002"
    old.mkdir()
    save_file({"w": torch.zeros(2)}, str(old / "weights.safetensors"))
    torch.save({"step": 2, "train": {"step": 2}}, old / "state.pt")
    (old / "meta.json").write_text(json.dumps({"step": 2}))
    assert ck.latest_checkpoint(tmp_path) == old and ck.is_legacy(old)
    with pytest.raises(ValueError, match="pre-DCP checkpoint"):
        ck.load_checkpoint(old, {})
    weights, state, meta = ck.load_legacy(old)
    assert state["step"] == 2 and meta["step"] == 2 and torch.equal(weights["w"], torch.zeros(2))


def test_export_hf_matches_trained_weights(tmp_path):
    eng = _engine(0, steps=2)
    path = _save(tmp_path / "ck", 2, eng)
    from fp8rl_core.checkpoint import main as export_main  # the `python -m fp8rl_core.checkpoint` entry point

    assert export_main(["export", str(path), str(tmp_path / "hf")]) == 0
    back = load_pretrained(tmp_path / "hf", dtype=torch.float32)
    for k, v in eng.model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
