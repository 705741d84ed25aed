"""The FP8 GEMM executor chosen by measurement (fp8rl_core/fp8/calibrate.py, choice.py): the decision on injected
timings, the disk cache (key, lock, reuse, a corrupted file), pinning precedence, and one choice per sweep.
No test here depends on the machine's speed: timings are injected wherever a choice is asserted."""
from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from fp8rl_core.fp8 import calibrate, choice, gemm
from fp8rl_core.fp8.calibrate import Calibration, choose


@pytest.fixture(autouse=True)
def clean(monkeypatch, tmp_path):
    """Calibration on (conftest turns it off for every other test), a private cache, no pin left behind, and
    the candidates of an AVX2 CPU (default first) whatever this CPU runs."""
    monkeypatch.delenv(calibrate.ENV_CALIBRATE, raising=False)
    monkeypatch.setattr(calibrate, "candidates", lambda: ["emulated", "emulated_blockwise"])
    monkeypatch.delenv(gemm.ENV_VAR, raising=False)
    monkeypatch.setenv(calibrate.ENV_CACHE, str(tmp_path / "cache"))
    yield
    gemm.pin_executor(None)


def fake(timings: dict[str, float], calls: list | None = None, delay: float = 0.0):
    """A measure_fn returning `timings` for the candidates asked (counting its calls)."""
    def measure(names: list[str]) -> dict[str, float]:
        if calls is not None:
            calls.append(names)
        time.sleep(delay)
        return {n: timings[n] for n in names if n in timings}

    return measure


# --- the decision: a pure function of the timings, the default and the margin


@pytest.mark.parametrize("timings,default,want", [
    ({"emulated": 1.0, "cpu_bf16dot": 0.68}, "emulated", "cpu_bf16dot"),  # 1.47x (EPYC AVX512_BF16): kept
    ({"emulated": 1.0, "cpu_bf16dot": 0.88}, "emulated", "emulated"),  # 1.14x: under the margin
    ({"emulated": 1.0, "cpu_bf16dot": 1.0 / 1.15}, "emulated", "cpu_bf16dot"),  # exactly the margin
    ({"emulated": 1.0, "emulated_blockwise": 2.5}, "emulated", "emulated"),  # the default is fastest
    ({"cpu_bf16dot": 1.0, "emulated": 0.9}, "cpu_bf16dot", "cpu_bf16dot"),  # AMX default kept: 1.11x only
    ({"cpu_bf16dot": 1.0, "emulated": 0.5}, "cpu_bf16dot", "emulated"),
    ({"cpu_bf16dot": 0.5}, "emulated", "emulated"),  # the default was not measured: nothing to beat
    ({}, "emulated", "emulated"),
])
def test_choose_keeps_the_fastest_only_by_the_margin(timings, default, want):
    assert choose(timings, default) == want


def test_choose_margin_is_a_parameter():
    t = {"emulated": 1.0, "cpu_bf16dot": 0.9}
    assert choose(t, "emulated", margin=0.10) == "cpu_bf16dot" and choose(t, "emulated", margin=0.2) == "emulated"


def test_candidates_are_what_this_cpu_runs_default_first(monkeypatch):
    from fp8rl_core.fp8 import cpu_gemm

    monkeypatch.undo()  # the real candidates (the fixture's env is set again below)
    monkeypatch.delenv(calibrate.ENV_CALIBRATE, raising=False)
    names = calibrate.candidates()
    assert names[0] == gemm.default_executor("cpu") and len(set(names)) == len(names)
    assert set(names) == {"emulated", "emulated_blockwise"} | ({"cpu_bf16dot"} if cpu_gemm.path() else set())
    monkeypatch.setenv("FP8RL_CPU_FLAGS_OFF", "amx_bf16 amx_tile avx512_bf16")
    assert calibrate.candidates() == ["emulated", "emulated_blockwise"]


# --- the cache


def test_cache_measures_once_and_is_keyed_by_cpu_flags_kernels_and_threads(monkeypatch, tmp_path):
    calls: list = []
    first = calibrate.calibrate(fake({"emulated": 2.0, "emulated_blockwise": 1.0}, calls))
    assert first.executor == "emulated_blockwise" and not first.cached and len(calls) == 1
    assert calls[0] == ["emulated", "emulated_blockwise"]
    path = tmp_path / "cache" / f"{calibrate.cache_key()}.json"
    assert json.loads(path.read_text())["executor"] == "emulated_blockwise"
    again = calibrate.calibrate(fake({"emulated": 1.0, "emulated_blockwise": 9.0}, calls))
    assert again.executor == "emulated_blockwise" and again.cached and len(calls) == 1  # reused, not remeasured
    key = calibrate.cache_key()
    monkeypatch.setenv("FP8RL_CPU_FLAGS_OFF", "avx2")
    assert calibrate.cache_key() != key  # other flags: another calibration
    monkeypatch.delenv("FP8RL_CPU_FLAGS_OFF")
    with monkeypatch.context() as m:
        m.setattr(calibrate, "kernel_version", lambda: "another-kernel")
        assert calibrate.cache_key() != key
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(old + 1)
        assert calibrate.cache_key() != key
    finally:
        torch.set_num_threads(old)


def test_kernel_version_hashes_the_c_sources_and_header(monkeypatch, tmp_path):
    for name in calibrate.KERNEL_SOURCES:
        (tmp_path / name).write_text(name)
    monkeypatch.setattr(calibrate, "__file__", str(tmp_path / "calibrate.py"))
    v = calibrate.kernel_version()
    (tmp_path / "fp8rl_kernels.h").write_text("#define FP8RL_NEW 1")
    assert calibrate.kernel_version() != v


@pytest.mark.parametrize("content", ["{not json", json.dumps({"executor": "cpu_bf16dot"}),
                                     json.dumps({"executor": "bogus", "default": "emulated", "timings_s": {},
                                                 "key": "?"})])
def test_a_corrupted_cache_is_recalibrated_with_a_warning(tmp_path, content):
    path = tmp_path / "cache" / f"{calibrate.cache_key()}.json"
    path.parent.mkdir(parents=True)
    path.write_text(content)
    calls: list = []
    with pytest.warns(UserWarning, match="calibration cache .* is unreadable.*calibrating again"):
        cal = calibrate.calibrate(fake({"emulated": 1.0, "emulated_blockwise": 3.0}, calls))
    assert cal.executor == "emulated" and len(calls) == 1
    assert json.loads(path.read_text())["key"] == calibrate.cache_key()  # rewritten whole


def test_concurrent_calibrations_wait_on_the_lock_and_measure_once():
    calls: list = []
    results: list[Calibration] = []
    measure = fake({"emulated": 1.0, "emulated_blockwise": 3.0}, calls, delay=0.3)
    threads = [threading.Thread(target=lambda: results.append(calibrate.calibrate(measure))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and sorted(r.cached for r in results) == [False, True, True]


def test_calibration_off_measures_nothing(monkeypatch):
    monkeypatch.setenv(calibrate.ENV_CALIBRATE, "0")
    cal = calibrate.calibrate(fake({}, calls := []))
    assert cal.executor == gemm.default_executor("cpu") and not calls and "not measured" in cal.describe()


def test_measure_runs_each_candidate_on_fprop_dgrad_and_wgrad():
    """Real (tiny) measurement: a time per executor, within the budget; which is faster is not asserted."""
    t0 = time.perf_counter()
    got = calibrate.measure(["emulated", "emulated_blockwise"], shapes=((8, 128, 128),), budget_s=0.2)
    assert set(got) == {"emulated", "emulated_blockwise"} and all(0 < v < 5 for v in got.values())
    assert time.perf_counter() - t0 < 5
    assert gemm._trial is None  # the trials leave no executor behind


def test_measure_leaves_out_an_executor_that_cannot_run():
    with pytest.warns(UserWarning, match="scaled_mm failed"):
        got = calibrate.measure(["emulated", "scaled_mm"], shapes=((4, 128, 128),), budget_s=0.05)
    assert set(got) == {"emulated"}


# --- precedence: per-call override > fp8.gemm > $FP8RL_GEMM > the decision > the static rule


def refuse():
    raise AssertionError("calibrated although the executor was fixed")


def test_a_pin_or_the_env_fixes_the_executor_without_calibrating(monkeypatch):
    got = choice.settle_executor("emulated_blockwise", "cpu", calibrate_fn=refuse)
    assert got == ("emulated_blockwise", "pinned (fp8.gemm)")
    monkeypatch.setenv(gemm.ENV_VAR, "emulated_blockwise")
    assert choice.settle_executor("auto", "cpu", calibrate_fn=refuse) == ("emulated_blockwise", "$FP8RL_GEMM")
    with pytest.raises(ValueError, match="pins 'emulated' but"):
        choice.settle_executor("emulated", "cpu", calibrate_fn=refuse)


def test_the_decision_is_used_until_unpinned(monkeypatch):
    cal = Calibration("emulated_blockwise", "emulated", {"emulated": 2.0, "emulated_blockwise": 1.0}, "k")
    got = choice.settle_executor("auto", "cpu", calibrate_fn=lambda: cal)
    assert got.executor == "emulated_blockwise" and got.how.startswith("calibrated: emulated_blockwise 1000.0 ms")
    assert gemm.select_executor("cpu") == "emulated_blockwise"
    assert gemm.select_executor("cpu", "emulated") == "emulated"  # a per-call override still wins
    monkeypatch.setenv(gemm.ENV_VAR, "emulated")
    assert gemm.select_executor("cpu") == "emulated"  # the env wins over the decision
    monkeypatch.delenv(gemm.ENV_VAR)
    monkeypatch.setenv("FP8RL_CPU_FLAGS_OFF", "amx_bf16 avx512_bf16")  # made under other flags: not applied
    assert gemm.select_executor("cpu") == "emulated"
    monkeypatch.delenv("FP8RL_CPU_FLAGS_OFF")
    gemm.pin_executor("auto")  # a run's "auto" keeps the decision ...
    assert gemm.select_executor("cpu") == "emulated_blockwise"
    gemm.pin_executor(None)  # ... None forgets it
    assert gemm.select_executor("cpu") == gemm.default_executor("cpu")


def test_cuda_keeps_the_static_rule(monkeypatch):
    monkeypatch.setattr(gemm, "default_executor", lambda device: "emulated")
    assert choice.settle_executor("auto", "cuda", calibrate_fn=refuse) == ("emulated", "default (cuda: static rule)")


# --- one choice per sweep


def test_the_cells_of_a_sweep_share_the_first_cells_choice(tmp_path):
    shared = tmp_path / "cells" / choice.SHARED_FILE
    first = choice.settle_executor("auto", "cpu", shared, calibrate_fn=lambda: Calibration(
        "emulated_blockwise", "emulated", {"emulated": 2.0, "emulated_blockwise": 1.0}, "k"))
    # a later cell whose own calibration says otherwise (another node, another load) runs the sweep's choice
    later = choice.settle_executor("auto", "cpu", shared, calibrate_fn=refuse)
    assert first.executor == later.executor == "emulated_blockwise" == gemm.select_executor("cpu")
    assert later.how.startswith(f"sweep ({shared}: emulated_blockwise 1000.0 ms")
    assert json.loads(shared.read_text())["executor"] == "emulated_blockwise"


def test_cells_starting_together_calibrate_once(tmp_path):
    shared, calls, got = tmp_path / "cells" / choice.SHARED_FILE, [], []

    def cell(i):
        def cal():
            calls.append(i)
            time.sleep(0.2)
            return Calibration(["emulated", "emulated_blockwise"][i % 2], "emulated", {"emulated": 1.0}, "k")
        got.append(choice._automatic(shared, cal)[0])

    threads = [threading.Thread(target=cell, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(got)) == 1


def test_a_corrupted_sweep_file_is_chosen_again_with_a_warning(tmp_path):
    shared = tmp_path / choice.SHARED_FILE
    shared.write_text('{"executor": ')
    with pytest.warns(UserWarning, match="sweep's FP8 GEMM choice .* is unreadable"):
        got = choice.settle_executor("auto", "cpu", shared, calibrate_fn=lambda: Calibration(
            "emulated", "emulated", {"emulated": 1.0}, "k"))
    assert got.executor == "emulated" and json.loads(shared.read_text())["executor"] == "emulated"


def test_a_node_that_cannot_run_the_sweeps_choice_stops_with_the_fix(monkeypatch, tmp_path):
    shared = tmp_path / choice.SHARED_FILE
    shared.write_text(json.dumps({"executor": "cpu_bf16dot", "cpu": "Xeon", "flags": "amx_bf16",
                                  "calibration": "..."}))
    monkeypatch.setattr(calibrate, "candidates", lambda: ["emulated", "emulated_blockwise"])
    with pytest.raises(RuntimeError, match="this sweep's cells run 'cpu_bf16dot'.*fp8.gemm: emulated"):
        choice.settle_executor("auto", "cpu", shared, calibrate_fn=refuse)


def test_a_sweep_cell_shares_the_file_beside_its_cell_folders(tmp_path):
    from fp8rl_core.config import load_run_config
    from fp8rl_core.loop.builder import gemm_choice_file

    cells = [load_run_config(None, [f"output_dir={tmp_path / 'sweep' / 'cells' / cid}", "tracking.parent_run_id=p"])
             for cid in ("abc", "def")]
    assert {gemm_choice_file(c) for c in cells} == {tmp_path / "sweep" / "cells" / choice.SHARED_FILE}
    assert gemm_choice_file(load_run_config(None, [f"output_dir={tmp_path / 'run'}"])) is None  # a lone run


def test_print_config_note_measures_nothing(monkeypatch):
    assert choice.note("emulated", "cpu") == "emulated (pinned by fp8.gemm)"
    assert choice.note("auto", "cpu").startswith("calibrated at run start (not cached here yet")
    calibrate.calibrate(fake({"emulated": 1.0, "emulated_blockwise": 3.0}))
    assert choice.note("auto", "cpu").startswith("emulated (cached calibration: emulated 1000.0 ms")
    monkeypatch.setenv(gemm.ENV_VAR, "emulated_blockwise")
    assert choice.note("auto", "cpu") == "emulated_blockwise ($FP8RL_GEMM)"

