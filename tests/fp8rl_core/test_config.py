"""RunConfig: typed validation with errors that name the key and the valid choices; stable ids."""
import pytest

from fp8rl_core.config import RunConfig, load_run_config, run_config_hash
from fp8rl_core.schema import ConfigError, flatten, to_dict


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
])
def test_bad_values_name_key_and_choices(override, fragment):
    with pytest.raises(ConfigError) as e:
        load_run_config(None, [override])
    assert fragment in str(e.value)


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
