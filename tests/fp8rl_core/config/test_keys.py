"""The table of run-config keys (run_config.KEYS, one schema.KeySpec row per key): the tables the code reads
are derived from it and equal, value for value, the hand-written ones they replaced (so no cell id moves),
every row names a real key, and a row that cannot work is refused when it is written."""
from __future__ import annotations

import pytest

from fp8rl_core.config import KEYS, RunConfig, load_run_config, run_config_hash
from fp8rl_core.config import run_config as rc
from fp8rl_core.config.schema import KeySpec, Range, at_least, get_dotted, to_dict

# The tables as they were written by hand before KEYS (issue 33): the cell-id rules must not change.
OLD_HASH_IF_NOT_DEFAULT = {"engines.vllm": rc.VllmSpec, "engines.megatron": rc.MegatronSpec,
                           "parallel.grad_reduce": "micro_batch", "parallel.reshard_after_forward": True,
                           "parallel.mixed_precision": "none",
                           "engines.kernels": "distinct", "task.scratchpad": False,
                           "fp8.format": "block128", "fp8.lm_head": "bf16",
                           "train.padding_free": False, "fp8.gemm": "auto",
                           "train.mismatch_guard": rc.MismatchGuardSpec, "train.val_batch_size": 512,
                           "task.dataset": None, "task.options": {}, "task.train_size": 10_000,
                           "task.instruction": "", "task.extract": "last_number"}
OLD_HASH_FP8_TRAINING_ONLY = ("fp8.quantize_from",)
OLD_FP8_ONLY_KEYS = ("fp8.quantize_from", "fp8.format", "fp8.lm_head", "fp8.gemm")
OLD_NATIVE_ONLY = [("fp8.format", "block128"), ("fp8.lm_head", "bf16"), ("fp8.quantize_from", "bf16"),
                   ("fp8.gemm", "auto")]  # _check_low_precision_knobs' list, in its order (the first one set is named)
OLD_RANGE_COUNT = 58
# keys added since, each hashed only when set (so the ids above stay), with a range
ADDED_WHEN_SET = {"loss.is_seq_low": 0.0, "loss.is_seq_high": 3.0, "loss.is_prob_low": 0.2,  # issue 34
                  "loss.is_prob_high": 0.2, "loss.rollout_kl_coef": 0.0}
# keys added since without a range (not numeric), each hashed only when set; the KV cache's are not fp8-only (the
# bf16 recipe's generation engine has a KV cache too) nor native_only (refused off native by _check_kv_cache)
ADDED_WHEN_SET_NO_RANGE = {"fp8.kv_cache": "auto", "fp8.kv_scale": "trainer", "fp8.kv_quantize_from": "bf16"}


def test_the_derived_tables_equal_the_hand_written_ones():
    assert rc.HASH_IF_NOT_DEFAULT == {**OLD_HASH_IF_NOT_DEFAULT, **ADDED_WHEN_SET, **ADDED_WHEN_SET_NO_RANGE}
    assert rc.HASH_FP8_TRAINING_ONLY == OLD_HASH_FP8_TRAINING_ONLY
    assert sorted(rc.FP8_ONLY_KEYS) == sorted(OLD_FP8_ONLY_KEYS) and len(rc.FP8_ONLY_KEYS) == 4
    assert list(rc.NATIVE_ONLY_KEYS.items()) == OLD_NATIVE_ONLY
    assert len(rc.RANGES) == OLD_RANGE_COUNT + len(ADDED_WHEN_SET)
    assert all(isinstance(r, Range) for r in rc.RANGES.values())
    assert rc.RANGES["seed"] == Range(0, 2**31 - 1, why="vLLM and numpy take 32-bit seeds; ranks' seeds are "
                                                         "31-bit too")
    assert rc.RANGES["train.val_batch_size"] == at_least(1) and rc.RANGES["task.train_size"] == at_least(1)


def test_every_row_names_a_real_key_once():
    data = to_dict(RunConfig())
    missing = object()
    assert [k.key for k in KEYS if get_dotted(data, k.key, missing) is missing] == []
    keys = [k.key for k in KEYS]
    assert len(keys) == len(set(keys))


def test_hashed_when_set_defaults_are_todays_defaults():
    """A frozen default that no longer matches the dataclass would hash every untouched config with the key."""
    data = to_dict(RunConfig())
    for k in KEYS:
        if k.hashed != "always" or k.native_only:
            assert get_dotted(data, k.key) == rc.unset_value(k.default), k.key


def test_a_native_only_knob_names_the_first_one_set():
    with pytest.raises(Exception, match=r"fp8\.quantize_from: 'master' runs in the native engines only"):
        load_run_config(None, ["recipe=fp8_e2e", "engines.training=megatron", "fp8.quantize_from=master",
                               "fp8.gemm=emulated"])


def test_a_row_that_cannot_work_is_refused():
    with pytest.raises(ValueError, match="need the key's default"):
        KeySpec("fp8.new_knob", hashed="when_set")
    with pytest.raises(ValueError, match="need the key's default"):
        KeySpec("fp8.new_knob", native_only=True)
    with pytest.raises(ValueError, match="fp8_only is for fp8"):
        KeySpec("train.new_key", default=0, hashed="when_set", fp8_only=True)
    with pytest.raises(ValueError, match="valid: always, when_set"):
        KeySpec("train.new_key", default=0, hashed="sometimes")


def test_one_row_is_a_knob(monkeypatch):
    """Adding a row is all the bookkeeping a key added after ids existed needs: here an existing key
    (task.instruction) taken out and put back through a patched table moves exactly the ids it should."""
    set_ = run_config_hash(load_run_config(None, ["task.instruction=hi"]))
    unset = run_config_hash(load_run_config(None, []))
    without = {k: v for k, v in rc.HASH_IF_NOT_DEFAULT.items() if k != "task.instruction"}
    monkeypatch.setattr(rc, "HASH_IF_NOT_DEFAULT", without)
    assert run_config_hash(load_run_config(None, [])) != unset  # "" now enters every id
    monkeypatch.setattr(rc, "HASH_IF_NOT_DEFAULT", rc.defaults_where(KEYS, hashed="when_set"))
    assert run_config_hash(load_run_config(None, [])) == unset
    assert run_config_hash(load_run_config(None, ["task.instruction=hi"])) == set_ != unset
