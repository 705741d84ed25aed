"""The vLLM engine against the real vLLM (0.32, its CPU build: scripts/setup_vllm.sh, which scripts/test.sh
runs), each scenario in a spawned process (_vllm_real.py: vLLM changes torch process-wide).

Skipped only where vLLM's CPU build cannot run, naming why: Python < 3.11, an x86 CPU without avx2 (the
wheel's lowest kernels), or a CUDA machine (it runs vLLM's CUDA build: the `cuda` tests). Not installed
where it could run is a failure, with the install command: the README's test command installs it.

Bounds, measured on the named tiny model (_vllm_real.TINY, 32 prompts x 24 sampled tokens at T = 1):
vLLM BF16 against our trainer (BF16) and against transformers (BF16, eager): token_mult_prob_error
<= MISMATCH_BOUND and |delta log p| <= MAX_ABS_BOUND (measured: docs/design.md, "vLLM on every machine").
"""
from __future__ import annotations

import importlib.util
import platform
import sys
from pathlib import Path

import pytest
import torch

from fp8rl_core.fp8 import cpu_features

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
import _vllm_real as real  # noqa: E402
from _ranks import run_ranks  # noqa: E402

MISMATCH_BOUND = 1.04  # token_mult_prob_error, vLLM BF16 vs a BF16 rescoring of the same weights
MAX_ABS_BOUND = 0.25  # the largest |delta log p| of one token


def _cannot_run() -> str | None:
    if sys.version_info < (3, 11):
        return f"vLLM 0.32 needs Python >= 3.11 (this is {platform.python_version()})"
    if platform.machine() in ("x86_64", "AMD64") and not cpu_features.has("avx2"):
        return "vLLM's CPU build needs the CPU flag avx2, which this CPU lacks"
    if torch.cuda.is_available():
        return "a CUDA machine runs vLLM's CUDA build, not the CPU build (the `cuda` tests cover it)"
    return None


pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(_cannot_run() is not None, reason=str(_cannot_run()))]


@pytest.fixture(scope="module")
def installed():
    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vLLM's CPU build is not installed: bash scripts/setup_vllm.sh (scripts/test.sh runs it)")


@pytest.fixture(scope="module")
def main(installed, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm_main")
    (result,) = run_ranks(1, real.main_engine, str(tmp), timeout_s=600)
    print(real.dump({k: v for k, v in result.items() if k in ("scores", "tags", "kv_cache_bytes")}))
    return tmp, result


def test_refused_before_start_with_the_key_named(main):
    _, r = main
    assert "engines.vllm.max_model_len" in r["prompt_too_long"] and "cannot hold the longest prompt" in \
        r["prompt_too_long"] and not r["started"]
    assert r["sleep_on_cpu"].startswith("ValueError: engines.vllm.sleep_between_steps: vLLM's CPU build has no sleep")
    if cpu_features.has("amx_tile"):
        assert r["fp8_gen"].startswith("ValueError: engines.vllm.fp8_weight_only") and r["fp8_gen_weight_only"] == ""
    else:
        assert "amx_tile" in r["fp8_gen"] and "amx_tile" in r["fp8_gen_weight_only"]


def test_start_and_generate_reproducibly_under_request_seeds(main):
    _, r = main
    first, again = r["first"], r["again"]
    assert first["ids"] == again["ids"] and first["logprobs"] == again["logprobs"]
    lengths = [sum(m) for m in first["mask"]]
    assert len(first["ids"]) == 32 and max(lengths) == real.MAX_NEW
    assert len(set(map(tuple, first["ids"]))) > 24  # one seed per request: the rows differ
    assert r["tags"] == {"fp8rl.vllm.version": "0.32.0", "fp8rl.vllm.device": "cpu",
                         "fp8rl.vllm.fp8_kernel": "none", "fp8rl.vllm.fp8_quantizes": "none"}
    assert r["threads_after_start"] == 2  # vLLM would have cut the trainer's threads to 1
    assert r["unknown_engine_args"] == []  # every argument we send is one of vLLM 0.32's EngineArgs


def test_logprobs_match_our_trainer_and_transformers(main):
    _, r = main
    for scorer in ("native", "transformers"):
        s = r["scores"][scorer]
        assert s["tokens"] > 300
        assert 1.0 < s["token_mult_prob_error"] <= MISMATCH_BOUND, (scorer, s)
        assert s["max_abs_diff"] <= MAX_ABS_BOUND, (scorer, s)


def test_every_eos_id_stops_vllm(main):
    """vLLM's raw outputs (before our conversion cuts anything): a row ends at its first EOS id, and each of
    the model's three EOS ids ended some row."""
    _, r = main
    eos = set(real.TINY.eos_ids)
    ended = set()
    for row in r["raw_ids"]:
        hits = [t for t, tok in enumerate(row) if tok in eos]
        if hits:
            assert hits == [len(row) - 1], row
            ended.add(row[-1])
        else:
            assert len(row) == real.MAX_NEW
    assert ended == eos


def test_kv_cache_is_sized_in_bytes_from_the_run(main):
    from fp8rl_core.engines.vllm_convert import kv_cache_bytes

    _, r = main
    assert r["batch_rows"] == 8 * 4  # prompts_per_step x samples_per_prompt on one rank
    assert r["kv_cache_bytes"] == kv_cache_bytes(real.TINY, r["max_model_len"], 32, dtype_bytes=2)


@pytest.fixture(scope="module")
def fresh(main):
    tmp, _ = main
    (result,) = run_ranks(1, real.fresh_engine, str(tmp), timeout_s=600)
    return result


def test_refit_equals_a_fresh_engine_bit_for_bit(main, fresh):
    """After 3 AdamW steps, the refit engine samples what an engine started on those weights samples: the
    same tokens and the same log-probs, bit for bit (the refit self-check peers run)."""
    _, r = main
    assert r["refit"]["ids"] != r["first"]["ids"]  # the new weights changed the samples
    assert r["refit"]["ids"] == fresh["ids"] and r["refit"]["logprobs"] == fresh["logprobs"]


def test_two_ranks_with_external_launcher_over_gloo(installed, tmp_path):
    from fp8rl_core.engines.vllm_convert import kv_cache_bytes
    from fp8rl_core.loop.builder import rank_seed

    results = run_ranks(2, real.two_ranks, str(tmp_path), timeout_s=600)
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["seed"] for r in results] == [rank_seed(real.SEED, 0), rank_seed(real.SEED, 1)]
    assert all(0 <= r["seed"] < 2**31 for r in results)
    assert all(r["executor"] == "ExecutorWithExternalLauncher" for r in results)
    for r in results:  # each rank's KV cache holds its own rows: 8 x 4 / 2
        assert r["batch_rows"] == 16 and r["kv_cache_bytes"] == kv_cache_bytes(real.TINY, r["max_model_len"], 16, 2)
    assert results[0]["ids"] != results[1]["ids"]  # rank-distinct sampling streams


@pytest.mark.skipif(not cpu_features.has("amx_tile"), reason="vLLM's CPU FP8 kernel needs the CPU flag amx_tile")
def test_block_fp8_weight_only_on_an_amx_cpu(installed, tmp_path):
    (r,) = run_ranks(1, real.fp8_weight_only, str(tmp_path), timeout_s=600)
    assert r["tags"]["fp8rl.vllm.fp8_kernel"] == "CPUFp8BlockScaledMMKernel"
    assert r["tags"]["fp8rl.vllm.fp8_quantizes"] == "weights" and r["finite"]


def test_fp8rl_train_with_vllm_generation_on_a_cpu_logs_the_mismatch(installed, tmp_path):
    """The README's `fp8rl-train engines.generation=vllm recipe=bf16`, on the tiny preset for 2 steps: every
    step logs token_mult_prob_error between vLLM's samples and our trainer, and the run is tagged with the
    vLLM that served it."""
    import subprocess

    import mlflow

    db = f"sqlite:///{tmp_path / 'mlflow.db'}"
    model = real.write_tiny(tmp_path / "model")  # a checkpoint of our own: no warm start to train first
    cmd = [sys.executable, "-m", "fp8rl_core.cli", "engines.generation=vllm", "recipe=bf16", f"model.path={model}",
           "threads=2", "task.val_size=8", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
           "rollout.max_new_tokens=6", "train.steps=2", "train.val_every=2", f"output_dir={tmp_path / 'out'}",
           f"tracking.uri={db}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    client = mlflow.MlflowClient(db)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    history = client.get_metric_history(run.info.run_id, "token_mult_prob_error")
    assert len({m.step for m in history}) == 2 and all(1.0 <= m.value < MISMATCH_BOUND for m in history)
    assert run.data.tags["fp8rl.vllm.device"] == "cpu" and run.data.tags["fp8rl.vllm.version"] == "0.32.0"
