"""RunConfig: typed validation with errors that name the key and the valid choices; stable ids."""
import pytest

from fp8rl_core.config import RunConfig, hashed_dict, load_run_config, run_config_hash
from fp8rl_core.config.schema import ConfigError, flatten, stable_hash, to_dict


def test_defaults_and_overrides_typed():
    cfg = load_run_config(None, ["recipe=fp8_e2e", "loss.importance_sampling=tis", "optim.lr=3e-4", "seed=3"])
    assert cfg.recipe == "fp8_e2e" and cfg.loss.importance_sampling == "tis"
    assert cfg.optim.lr == pytest.approx(3e-4) and cfg.seed == 3 and isinstance(cfg.optim.lr, float)


@pytest.mark.parametrize("override, fragment", [
    ("recipe=fp9", "recipe: unknown recipe 'fp9'; valid: bf16, fp8_gen, fp8_e2e"),
    ("loss.importance_sampling=tok", "loss.importance_sampling: 'tok' is not allowed; valid: none, token"),
    ("optim.lr=fast", "optim.lr: expected float"),
    ("nope=1", "nope: unknown key; valid: recipe, seed"),
    ("rollout.temperature=0", "rollout.temperature: must be > 0"),
    ("fp8.power_of_two_scales=3", "fp8.power_of_two_scales: expected true or false"),
    ("seed=true", "seed: expected an integer"),
    ("task.operators=[/]", "task.operators"),
    ("train", "train: an override must read key=value"),
    ("parallel.grad_reduce=never", "parallel.grad_reduce: 'never' is not allowed; valid: micro_batch, step"),
    ("model.bf16_compute=fast", "model.bf16_compute: 'fast' is not allowed; valid: auto, native, emulated"),
    ("fp8.quantize_from=fp32", "fp8.quantize_from: 'fp32' is not allowed; valid: bf16, master"),
    ("engines.kernels=same", "engines.kernels: 'same' is not allowed; valid: distinct, matched"),
])
def test_bad_values_name_key_and_choices(override, fragment):
    with pytest.raises(ConfigError) as e:
        load_run_config(None, [override])
    assert fragment in str(e.value)


@pytest.mark.parametrize("overrides", [["task.scratchpad=true", "task.operators=[+, '*']"],
                                       ["task.scratchpad=true", "task.name=jsonl", "task.train_path=x.jsonl"]])
def test_scratchpad_is_refused_where_no_worked_completion_exists(overrides):
    """At the edge (sweep plan, --print-config), not inside a cell that then fails its retries."""
    with pytest.raises(ConfigError, match=r"task.scratchpad: .*\+ and - only; valid: false"):
        load_run_config(None, overrides)


def test_file_errors_name_the_file(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text("recipe: bf16\nloss:\n  clip_lo: 0.1\n")
    with pytest.raises(ConfigError) as e:
        load_run_config(p)
    assert str(p) in str(e.value) and "loss.clip_lo: unknown key" in str(e.value)


def test_hash_ignores_where_to_write_but_not_what_to_compute():
    a = load_run_config(None, ["output_dir=/x", "tracking.uri=sqlite:///a.db", "warmstart.cache_dir=/c"])
    b = load_run_config(None, [])
    assert run_config_hash(a) == run_config_hash(b)
    assert run_config_hash(load_run_config(None, ["seed=1"])) != run_config_hash(b)
    assert run_config_hash(load_run_config(None, ["loss.is_cap=3"])) != run_config_hash(b)
    # keys added after cell ids existed hash only where they differ from their defaults
    assert run_config_hash(load_run_config(None, ["parallel.grad_reduce=micro_batch"])) == run_config_hash(b)
    assert run_config_hash(load_run_config(None, ["parallel.grad_reduce=step"])) != run_config_hash(b)


def test_roundtrip_through_dict():
    cfg = load_run_config(None, ["recipe=fp8_gen", "task.operators=[+, '*']"])
    again = load_run_config(None, [f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}"
                                   for k, v in flatten(to_dict(cfg)).items() if v is not None and v != {}])
    assert to_dict(again) == to_dict(cfg)
    assert isinstance(RunConfig(), RunConfig)


# ---- model.bf16_compute, fp8.quantize_from, engines.kernels -----------------------------------------
def test_new_numerics_keys_defaults_and_values():
    cfg = load_run_config(None, [])
    assert (cfg.model.bf16_compute, cfg.fp8.quantize_from, cfg.engines.kernels) == ("auto", "bf16", "distinct")
    for mode in ("auto", "native", "emulated"):
        assert load_run_config(None, [f"model.bf16_compute={mode}"]).model.bf16_compute == mode
    assert load_run_config(None, ["fp8.quantize_from=master"]).fp8.quantize_from == "master"
    assert load_run_config(None, ["engines.kernels=matched"]).engines.kernels == "matched"


@pytest.mark.parametrize("engine", ["engines.generation=vllm", "engines.training=megatron"])
def test_emulated_bf16_and_matched_kernels_need_the_native_engines(engine):
    with pytest.raises(ConfigError) as e:
        load_run_config(None, ["model.bf16_compute=emulated", engine])
    assert "model.bf16_compute" in str(e.value) and engine.split("=")[0] in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_run_config(None, ["engines.kernels=matched", engine])
    assert "engines.kernels" in str(e.value) and engine.split("=")[0] in str(e.value)
    for ok in ("auto", "native"):  # the other engines run native BF16 kernels: nothing to refuse
        assert load_run_config(None, [f"model.bf16_compute={ok}", engine]).model.bf16_compute == ok


@pytest.mark.parametrize("recipe", ["bf16", "fp8_gen", "fp8_e2e"])
def test_bf16_compute_is_not_in_the_cell_id(recipe):
    """Native and emulated BF16 differ in summation order only: one cell, whatever the machine runs."""
    ids = {run_config_hash(load_run_config(None, [f"recipe={recipe}", f"model.bf16_compute={m}"]))
           for m in ("auto", "native", "emulated")}
    assert len(ids) == 1
    assert ids == {run_config_hash(load_run_config(None, [f"recipe={recipe}"]))}


def test_matched_kernels_change_the_cell_id_and_the_default_does_not():
    base = run_config_hash(load_run_config(None, []))
    assert run_config_hash(load_run_config(None, ["engines.kernels=distinct"])) == base
    assert run_config_hash(load_run_config(None, ["engines.kernels=matched"])) != base
    assert "kernels" not in hashed_dict(load_run_config(None, []))["engines"]


def _id_before_quantize_from(cfg) -> str:
    """The id this config had before fp8.quantize_from existed: its hashed dict without the key."""
    data = hashed_dict(cfg)
    data["fp8"].pop("quantize_from", None)
    return stable_hash(data)


def test_quantize_from_is_hashed_where_an_engine_quantizes():
    """fp8.quantize_from changes what fp8_e2e computes: its ids changed (the default hashes differently
    from before the key existed, and from `master`). fp8_gen's generation engine honours it since issue 23:
    `master` is a new cell, the default keeps fp8_gen's old id (the key is not in it). bf16 quantizes
    nothing, so the key never enters its id."""
    ids = {}
    for recipe in ("bf16", "fp8_gen", "fp8_e2e"):
        for source in ("bf16", "master"):
            ids[recipe, source] = run_config_hash(load_run_config(None, [f"recipe={recipe}",
                                                                          f"fp8.quantize_from={source}"]))
    assert ids["fp8_e2e", "bf16"] != ids["fp8_e2e", "master"]
    assert ids["fp8_gen", "bf16"] != ids["fp8_gen", "master"]
    assert ids["bf16", "bf16"] == ids["bf16", "master"]
    assert "quantize_from" not in hashed_dict(load_run_config(None, ["recipe=fp8_gen"]))["fp8"]
    for recipe in ("bf16", "fp8_gen", "fp8_e2e"):
        cfg = load_run_config(None, [f"recipe={recipe}"])
        assert ids[recipe, "bf16"] == run_config_hash(cfg)
        old = _id_before_quantize_from(cfg)
        if recipe == "fp8_e2e":
            assert run_config_hash(cfg) != old and "quantize_from" in hashed_dict(cfg)["fp8"]
        else:
            assert run_config_hash(cfg) == old and "quantize_from" not in hashed_dict(cfg)["fp8"]


def test_one_id_per_numerics_of_the_scale_knobs():
    """scale_format auto, the format's default and power_of_two_scales are spellings of one numerics:
    one id each way (no grid runs two cells that compute the same); the new fp8.* keys leave old ids and
    the bf16 recipe's id alone."""
    h = lambda *o: run_config_hash(load_run_config(None, ["recipe=fp8_e2e", *o]))  # noqa: E731
    assert h() == h("fp8.scale_format=fp32") == h("fp8.format=block128") == h("fp8.lm_head=bf16")
    assert h("fp8.scale_format=pow2") == h("fp8.power_of_two_scales=true") != h()
    assert h("fp8.format=tensorwise") != h("fp8.format=tensorwise", "fp8.scale_format=pow2")
    arms = ("fp8.format=tensorwise", "fp8.format=mxfp8", "fp8.format=nvfp4", "fp8.lm_head=fp8")
    assert len({h(), *(h(a) for a in arms)}) == 5
    bf16 = lambda *o: run_config_hash(load_run_config(None, ["recipe=bf16", *o]))  # noqa: E731
    assert bf16() == bf16("fp8.format=mxfp8") == bf16("fp8.lm_head=fp8") == bf16("fp8.scale_format=fp32")


def test_scale_formats_refuse_every_invalid_pair():
    from fp8rl_core.fp8.formats import FORMATS

    for fmt, f in FORMATS.items():
        for sf in ("fp32", "pow2", "e8m0", "e4m3_fp32"):
            overrides = [f"fp8.format={fmt}", f"fp8.scale_format={sf}"]
            if sf in f.scale_formats:
                assert load_run_config(None, overrides).fp8.resolved_scale_format() == sf
            else:
                with pytest.raises(ConfigError, match="fp8.scale_format: .* valid: auto, or one of the valid pairs"):
                    load_run_config(None, overrides)
    with pytest.raises(ConfigError, match="fp8.power_of_two_scales"):
        load_run_config(None, ["fp8.format=mxfp8", "fp8.power_of_two_scales=true"])
    with pytest.raises(ConfigError, match="fp8.format: unknown format 'fp6'; valid: block128"):
        load_run_config(None, ["fp8.format=fp6"])


def test_fp8_gemm_pin_enters_the_id_of_fp8_recipes_only_when_set():
    """fp8.gemm (issue 29): auto keeps every old id; a pinned executor is its own cell for the recipes that
    quantize, and never enters the bf16 recipe's id (it runs no FP8 GEMM). Its choices are gemm.EXECUTORS."""
    import typing

    from fp8rl_core.config.run_config import Fp8Spec
    from fp8rl_core.fp8.gemm import EXECUTORS

    assert typing.get_args(typing.get_type_hints(Fp8Spec)["gemm"]) == ("auto", *EXECUTORS)
    for recipe in ("fp8_gen", "fp8_e2e"):
        h = lambda *o, r=recipe: run_config_hash(load_run_config(None, [f"recipe={r}", *o]))  # noqa: E731
        assert h("fp8.gemm=auto") == h()
        assert len({h(), h("fp8.gemm=emulated"), h("fp8.gemm=emulated_blockwise")}) == 3
        assert "gemm" not in hashed_dict(load_run_config(None, [f"recipe={recipe}"]))["fp8"]
    bf16 = lambda *o: run_config_hash(load_run_config(None, ["recipe=bf16", *o]))  # noqa: E731
    assert bf16() == bf16("fp8.gemm=emulated")
    with pytest.raises(ConfigError, match="fp8.gemm: 'te' is not allowed; valid: auto, emulated"):
        load_run_config(None, ["fp8.gemm=te"])


def test_rollout_correction_keys_issue_34():
    cfg = load_run_config(None, ["loss.importance_sampling=seq_mask"])
    assert (cfg.loss.is_seq_low, cfg.loss.is_seq_high, cfg.loss.is_prob_low, cfg.loss.is_prob_high) == (0, 3, .2, .2)
    with pytest.raises(ConfigError, match="loss.is_seq_low: need is_seq_low <= is_seq_high"):
        load_run_config(None, ["loss.is_seq_low=4"])
    with pytest.raises(ConfigError, match="loss.is_prob_low"):
        load_run_config(None, ["loss.is_prob_low=-0.1"])
    # wired through the loop (loop/step.py: importance_from_config with the advantages) and the training engine
    # (policy_loss with gen_logprobs): every knob loads and keeps its value
    cfg = load_run_config(None, ["loss.importance_sampling=dppo", "loss.is_prob_low=0.1", "loss.is_seq_high=2",
                                 "loss.rollout_kl_coef=0.001"])
    assert (cfg.loss.importance_sampling, cfg.loss.is_prob_low, cfg.loss.is_seq_high, cfg.loss.rollout_kl_coef) == (
        "dppo", 0.1, 2, 0.001)
