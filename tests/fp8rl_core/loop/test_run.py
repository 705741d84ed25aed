"""The single run: it learns signal end to end, and a resumed run is bit-identical to an uninterrupted one."""
import json

import pytest
import torch
from _tiny_runs import step_metrics, tiny_config  # beside this file (tests/fp8rl_core/loop)

from fp8rl_core.config import load_run_config
from fp8rl_core.loop.run import run
from fp8rl_core.model import bf16


def _tiny(tmp_path, name, *extra):
    return tiny_config(tmp_path, name, *extra)


def _metrics(path):
    return step_metrics(path, timings=False)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["bf16", "fp8_e2e"])
def test_resume_is_bit_identical(tmp_path, recipe):
    extra = [f"recipe={recipe}", "loss.importance_sampling=tis", "optim.micro_steps=2"]
    straight = _tiny(tmp_path, "straight", *extra)
    run(straight, progress=False)
    interrupted = _tiny(tmp_path, "interrupted", *extra)
    run(interrupted, progress=False, stop_after=3)  # checkpoint at 2, then stop at 3 (checkpointed too)
    run(interrupted, progress=False)
    a, b = _metrics(tmp_path / "straight"), _metrics(tmp_path / "interrupted")
    assert sorted(a) == [0, 1, 2, 3, 4]
    assert a == b  # every metric of every step, exactly (floats compared bit for bit via JSON)


def test_bad_override_is_rejected_before_any_work(tmp_path):
    from fp8rl_core.cli import main

    assert main(["recipe=fp16", f"output_dir={tmp_path / 'x'}"]) == 2
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_crash_between_checkpoints_resumes_without_duplicates(tmp_path, monkeypatch):
    """Killed after step 3 (last checkpoint: 2): the restart redoes step 3 and logs it once."""
    import fp8rl_core.loop.run as run_mod

    straight = _tiny(tmp_path, "straight")
    run(straight, progress=False)
    crashed = _tiny(tmp_path, "crashed")
    real_step, calls = run_mod.grpo_step, []

    def dying_step(ctx):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt("node lost")
        return real_step(ctx)

    monkeypatch.setattr(run_mod, "grpo_step", dying_step)
    with pytest.raises(KeyboardInterrupt):
        run(crashed, progress=False)
    monkeypatch.setattr(run_mod, "grpo_step", real_step)
    run(crashed, progress=False)
    steps = [json.loads(x)["step"] for x in (tmp_path / "crashed" / "metrics.jsonl").read_text().splitlines()
             if json.loads(x).get("kind") == "metrics"]
    assert sorted(steps) == sorted(set(steps)) == [0, 1, 2, 3, 4]
    assert _metrics(tmp_path / "crashed") == _metrics(tmp_path / "straight")


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["bf16", "fp8_e2e"])
def test_reused_old_logprobs_equal_the_two_pass_run(tmp_path, recipe):
    """micro_steps 1: taking the old log-probs from the training forward (one pass) instead of a separate
    no-grad pass changes no metric of any step, bit for bit (same weights, same kernels on this CPU)."""
    extra = [f"recipe={recipe}", "loss.importance_sampling=tis", "optim.micro_steps=1"]
    run(_tiny(tmp_path, "one_pass", *extra, "train.reuse_old_logprobs=true"), progress=False)
    run(_tiny(tmp_path, "two_pass", *extra, "train.reuse_old_logprobs=false"), progress=False)
    a, b = _metrics(tmp_path / "one_pass"), _metrics(tmp_path / "two_pass")
    assert sorted(a) == [0, 1, 2, 3, 4] and a == b


# ---- engines.kernels, val_accuracy_bf16_eval, model.bf16_compute end to end --------------------------


@pytest.fixture(scope="module")
def ws_dir(tmp_path_factory):
    """One warm-start cache for this module's runs (the BF16 paths share a key: warmstart_key)."""
    return tmp_path_factory.mktemp("ws")


def _tiny_ws(tmp_path, ws_dir, name, *extra):
    return _tiny(tmp_path, name, f"warmstart.cache_dir={ws_dir}", *extra)


def _logged(path, key):
    """{step: value} of one metric in metrics.jsonl."""
    return {s: v[key] for s, v in _metrics(path).items() if key in v}


@pytest.mark.slow
@pytest.mark.parametrize("recipe, path", [("bf16", "emulated"), ("fp8_e2e", "emulated"), ("fp8_gen", "emulated"),
                                          ("bf16", "native"), ("fp8_e2e", "native")])
def test_matched_kernels_give_the_zero_mismatch_floor(tmp_path, ws_dir, monkeypatch, recipe, path):
    """engines.kernels=matched: the old log-probs replay the generation engine's own computation, so bf16
    and fp8_e2e (trainer and sampler at the same precision) log token_mult_prob_error exactly 1.0 at
    every step; fp8_gen replays on a BF16 engine (its trainer's precision), so its FP8 sampling mismatch
    stays (> 1). On either BF16 path, which every engine of the run takes."""
    import fp8rl_core.loop.run as run_mod

    if path == "native" and not bf16.has_bf16_dot():
        pytest.skip(bf16.missing_bf16_dot())
    ctxs, real_build = [], run_mod.build_context
    monkeypatch.setattr(run_mod, "build_context", lambda *a, **kw: ctxs.append(real_build(*a, **kw)) or ctxs[-1])
    run(_tiny_ws(tmp_path, ws_dir, "run", f"recipe={recipe}", "engines.kernels=matched",
                 f"model.bf16_compute={path}"), progress=False)
    ctx = ctxs[0]
    engines = [ctx.gen, ctx.train] + ([ctx.bf16_gen] if recipe != "bf16" else [])
    assert [e.upcast_bf16 for e in engines] == [path == "emulated"] * len(engines)
    assert ctx.numerics["fp8rl.bf16_compute"] == path
    mismatch = _logged(tmp_path / "run", "token_mult_prob_error")
    assert sorted(mismatch) == [1, 2, 3, 4]
    if recipe == "fp8_gen":
        assert all(v > 1.0 for v in mismatch.values()), mismatch
    else:
        assert all(v == 1.0 for v in mismatch.values()), mismatch


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["bf16", "fp8_gen", "fp8_e2e"])
def test_val_accuracy_bf16_eval_at_every_validation_from_a_bf16_engine(tmp_path, ws_dir, monkeypatch, recipe):
    """val_accuracy_bf16_eval is logged at every validation step (0, 2, 4) and nowhere else. For bf16 it
    is val_accuracy itself (the arm's own engine, no second one); for the FP8-generating arms it is the
    val_accuracy of a second, BF16 engine (fp8 off) holding the trainer's current weights at that
    step, refit lazily: once per validation, not at every step."""
    import fp8rl_core.loop.run as run_mod
    from fp8rl_core.tracking import M_VAL_ACC, M_VAL_ACC_BF16_EVAL

    seen, ctxs = [], []
    real_build, real_validation = run_mod.build_context, run_mod.validation_metrics

    def build_context(*a, **kw):
        ctxs.append(real_build(*a, **kw))
        if ctxs[0].bf16_gen is not None:
            refit = ctxs[0].bf16_gen.refit
            ctxs[0].bf16_gen.refit = lambda w: (seen.append("refit"), refit(w))[1]
        return ctxs[0]

    def validation_metrics(gen, *a, **kw):
        ctx = ctxs[0]
        current = ctx.train.weights()["model.embed_tokens.weight"].to(gen.dtype)
        out = real_validation(gen, *a, **kw)
        seen.append((gen, gen.fp8, torch.equal(gen.embed, current), out[M_VAL_ACC]))
        return out

    monkeypatch.setattr(run_mod, "build_context", build_context)
    monkeypatch.setattr(run_mod, "validation_metrics", validation_metrics)
    run(_tiny_ws(tmp_path, ws_dir, "run", f"recipe={recipe}"), progress=False)
    ctx = ctxs[0]
    neutral = _logged(tmp_path / "run", M_VAL_ACC_BF16_EVAL)
    own = _logged(tmp_path / "run", M_VAL_ACC)
    assert sorted(neutral) == sorted(own) == [0, 2, 4]
    if recipe == "bf16":
        assert ctx.bf16_gen is None and neutral == own
        assert [(g is ctx.gen, fp8, fresh) for g, fp8, fresh, _ in seen] == [(True, False, True)] * 3
        return
    assert ctx.bf16_gen is not None and ctx.bf16_gen is not ctx.gen and not ctx.bf16_gen.fp8 and ctx.gen.fp8
    calls = [x if x == "refit" else x[:3] for x in seen]
    # the arm's engine, then one refit of the BF16 engine per validation (on every rank: under FSDP2 it
    # all-gathers; rank 0 after its arm has validated and slept) and the BF16 engine, both on the trainer's
    # current weights
    assert calls == [(ctx.gen, True, True), "refit", (ctx.bf16_gen, False, True)] * 3, calls
    assert list(neutral.values()) == [x[3] for x in seen if x != "refit" and x[0] is ctx.bf16_gen]


def _numerics_tags(path):
    """The run's own `tags` records of metrics.jsonl (one per attempt; the sink adds host tags apart)."""
    records = [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]
    return [r["values"] for r in records if r.get("kind") == "tags" and "world_size" in r["values"]]


@pytest.mark.slow
def test_numerics_tags_per_attempt_and_a_warning_when_a_resume_switches_path(tmp_path, ws_dir, sqlite_uri,
                                                                            monkeypatch):
    """The BF16 path, CPU flags and FP8 GEMM executor are MLflow tags of each attempt (not params); the
    checkpoint's rank state records the path; a resume on a CPU that resolves `auto` to the other path
    warns, updates the tags and leaves the params as they were."""
    from mlflow import MlflowClient

    from fp8rl_core.fp8.gemm import select_executor
    from fp8rl_core.io import checkpoint as ckpt
    from fp8rl_core.tracking import TAG_BF16_COMPUTE, TAG_CPU_FLAGS, TAG_FP8_GEMM

    if not bf16.has_bf16_dot():
        pytest.skip(bf16.missing_bf16_dot() + ": the resumed half runs native BF16")
    cfg = _tiny_ws(tmp_path, ws_dir, "run", "recipe=fp8_e2e", f"tracking.uri={sqlite_uri}")
    out = tmp_path / "run"
    with monkeypatch.context() as m:  # first attempt: an AVX2-only node, `auto` -> emulated
        m.setattr(bf16, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
        run(cfg, progress=False, stop_after=3)
    client, run_id = MlflowClient(sqlite_uri), (out / "mlflow_run_id").read_text().strip()
    first = client.get_run(run_id).data
    assert {k: first.tags[k] for k in (TAG_BF16_COMPUTE, TAG_CPU_FLAGS, TAG_FP8_GEMM)} == {
        TAG_BF16_COMPUTE: "emulated", TAG_CPU_FLAGS: "avx2", TAG_FP8_GEMM: select_executor("cpu")}
    assert not {TAG_BF16_COMPUTE, TAG_CPU_FLAGS, TAG_FP8_GEMM} & set(first.params)
    assert first.params["model.bf16_compute"] == "auto"
    assert ckpt.read_rank_state(ckpt.latest_checkpoint(out / "checkpoints"))["bf16_compute"] == "emulated"
    with pytest.warns(UserWarning, match="resuming with BF16 path 'native', the checkpoint was written with "
                                         "'emulated'"):
        run(cfg, progress=False)  # second attempt: this CPU (BF16 dot products), `auto` -> native
    second = client.get_run(run_id).data
    assert second.tags[TAG_BF16_COMPUTE] == "native" and second.tags[TAG_CPU_FLAGS] == bf16.recorded_flags()
    assert second.params == first.params
    assert [t[TAG_BF16_COMPUTE] for t in _numerics_tags(out)] == ["emulated", "native"]
    assert sorted(_metrics(out)) == [0, 1, 2, 3, 4]


def test_numerics_tags_name_the_path_flags_and_executor(monkeypatch):
    from fp8rl_core.fp8.gemm import select_executor
    from fp8rl_core.loop.builder import numerics_tags, resolve_setup

    monkeypatch.setattr(bf16, "cpu_flags", lambda: frozenset({"sse2", "avx2", "avx512f"}))
    tags_of = lambda *overrides: numerics_tags(resolve_setup(load_run_config(None, list(overrides)), "cpu"))  # noqa: E731
    assert tags_of() == {"fp8rl.bf16_compute": "emulated", "fp8rl.cpu_flags": "avx2,avx512f",
                         "fp8rl.fp8_gemm": select_executor("cpu")}
    assert tags_of("model.bf16_compute=native")["fp8rl.bf16_compute"] == "native"
    assert tags_of("model.dtype=fp32")["fp8rl.bf16_compute"] == "none"
    monkeypatch.setattr(bf16, "cpu_flags", lambda: frozenset())
    assert tags_of()["fp8rl.cpu_flags"] == "-"  # none of the recorded ones


def test_path_switch_warning_only_when_the_recorded_path_differs(tmp_path):
    from types import SimpleNamespace

    from fp8rl_core.loop.run import _warn_on_path_switch
    from fp8rl_core.tracking import TAG_BF16_COMPUTE

    cfg = _tiny(tmp_path, "x")

    def ctx(now, rank0=True):
        return SimpleNamespace(cfg=cfg, numerics={TAG_BF16_COMPUTE: now}, mesh=SimpleNamespace(is_rank0=rank0))

    with pytest.warns(UserWarning, match="'emulated', the checkpoint was written with 'native'"):
        _warn_on_path_switch(ctx("emulated"), "native")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _warn_on_path_switch(ctx("native"), "native")  # same path
        _warn_on_path_switch(ctx("native"), None)  # a checkpoint from before the key
        _warn_on_path_switch(ctx("native"), "")
        _warn_on_path_switch(ctx("emulated", rank0=False), "native")  # rank 0 alone says it


@pytest.mark.slow
def test_resume_is_bit_identical_with_emulated_bf16_and_matched_kernels(tmp_path, ws_dir):
    """fp8_gen with both new paths on (emulated BF16, matched kernels: the BF16 replay engine) resumes
    bit for bit, val_accuracy_bf16_eval included: the BF16 engine is refit from the restored weights."""
    extra = ["recipe=fp8_gen", "model.bf16_compute=emulated", "engines.kernels=matched",
             "loss.importance_sampling=tis"]
    run(_tiny_ws(tmp_path, ws_dir, "straight", *extra), progress=False)
    interrupted = _tiny_ws(tmp_path, ws_dir, "interrupted", *extra)
    run(interrupted, progress=False, stop_after=3)
    run(interrupted, progress=False)
    a, b = _metrics(tmp_path / "straight"), _metrics(tmp_path / "interrupted")
    assert sorted(a) == [0, 1, 2, 3, 4] and a == b
    assert "val_accuracy_bf16_eval" in a[4]


@pytest.mark.slow
def test_rollout_corrections_reach_the_loss_and_the_metrics(tmp_path):
    """Issue 34's corrections run through the loop: `dppo` reads the advantages (its masked-token fraction is
    logged with the sign and mask splits), and `loss.rollout_kl_coef` adds coef · mean ½(logp − gen)² to the
    step-1 loss (both runs generate the same rollouts from the same weights before their first update)."""
    extra = ["recipe=fp8_gen", "loss.importance_sampling=dppo", "train.steps=2", "train.val_every=2"]
    run(_tiny(tmp_path, "plain", *extra), progress=False)
    run(_tiny(tmp_path, "kl", *extra, "loss.rollout_kl_coef=0.5"), progress=False)
    plain, kl = _metrics(tmp_path / "plain")[1], _metrics(tmp_path / "kl")[1]
    assert 0.0 <= plain["token_fraction_is_masked"] <= 1.0
    assert plain["token_fraction_adv_pos"] + plain["token_fraction_adv_neg"] <= 1.0 + 1e-9
    for key in ("token_mult_prob_error_adv_pos", "logprob_abs_diff_median", "rollout_k2_kl"):
        assert key in plain, key
    assert plain["rollout_kl"] == kl["rollout_kl"] > 0.0  # logged at coef 0 too: the same rollouts, the same weights
    assert kl["loss"] - plain["loss"] == pytest.approx(0.5 * kl["rollout_kl"], rel=1e-4, abs=1e-7)
