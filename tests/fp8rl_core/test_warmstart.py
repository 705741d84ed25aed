"""Warm start: cached by config hash, shared across processes, and it actually teaches the task."""
import torch

from fp8rl_core.builder import load_tokenizer
from fp8rl_core.config import load_run_config
from fp8rl_core.tasks import make_task
from fp8rl_core.warmstart import sft_batch, warm_start, warmstart_key


def _cfg(tmp_path, *extra):
    return load_run_config(None, [f"warmstart.cache_dir={tmp_path}", "task.val_size=8", *extra])


def test_cached_by_key_and_zero_steps_allowed(tmp_path):
    cfg = _cfg(tmp_path, "warmstart.steps=0")
    tok, task = load_tokenizer(cfg), make_task(cfg.task)
    path = warm_start(cfg, tok, task, progress=False)
    assert (path / "config.json").exists() and (path / "tokenizer.json").exists()
    stamp = (path / "config.json").stat().st_mtime_ns
    assert warm_start(cfg, tok, task, progress=False) == path  # second call: found, not retrained
    assert (path / "config.json").stat().st_mtime_ns == stamp
    assert warmstart_key(_cfg(tmp_path / "elsewhere", "warmstart.steps=0")) == path.name  # cache dir not in key
    assert warmstart_key(_cfg(tmp_path, "warmstart.steps=1")) != path.name
    assert not list(tmp_path.glob(".tmp-*"))  # no temporary folder left behind


def test_sft_batch_masks_target_and_eos_only():
    cfg = load_run_config(None, ["task.val_size=8"])
    tok, task = load_tokenizer(cfg), make_task(cfg.task)
    ex = task.sample_train(0, 2)
    ids, mask = sft_batch(ex, tok, task)
    for i, e in enumerate(ex):
        n_prompt = len(tok.encode(e.prompt))
        target = ids[i][mask[i]].tolist()
        assert target == tok.encode(e.answer, add_bos=False) + [tok.eos_id]
        assert not mask[i, :n_prompt].any()
    assert ids.dtype == torch.long
