"""The pinned GPU stack (pyproject's `gpu` extra) and the backends' start-up version check
(engines/versions.py), with installed versions given as fakes (the real packages need CUDA)."""
from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from fp8rl_core.engines import versions as v

ROOT = Path(__file__).resolve().parents[3]


def fake(installed: dict[str, str]):
    return lambda dist: installed.get(dist)


def test_parse_version():
    assert v.parse_version("2.11.0+cu130") == (2, 11, 0)
    assert v.parse_version("0.25.1rc1") == (0, 25, 1) and v.parse_version("2.15.0.dev0") == (2, 15, 0)


def test_the_gpu_extra_is_the_tested_set():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = {}
    for req in extras["gpu"]:
        name, _, version = req.partition("==")
        pins[name.split("[")[0]] = version
    assert pins == {d: pin for d, (_, pin) in v.SUPPORTED.items()}
    for extra in ("vllm", "megatron"):  # the narrower extras pin the same versions
        assert all("==" in r and r.split("==")[1] == pins[r.split("==")[0].split("[")[0]] for r in extras[extra])


def test_the_tested_set_passes_silently():
    tested = {d: pin for d, (_, pin) in v.SUPPORTED.items()}
    assert v.check_stack(("vllm", "megatron-core", "transformer-engine"), get=fake(tested),
                         requires=lambda d: ["torch==2.11.0", "xformers; extra == 'x'"]) == []


def test_too_old_is_an_error_naming_the_supported_versions():
    old = {"torch": "2.11.0", "vllm": "0.9.0", "megatron-core": "0.16.1"}
    with pytest.raises(RuntimeError, match=r"vllm 0.9.0 is older than the oldest supported 0.10.2 \(tested: 0.25.1\)"
                                           r".*Supported: torch >= 2.6 \(tested 2.11.0\), vllm >= 0.10.2"):
        v.check_stack(("vllm",), get=fake(old), requires=lambda d: ["torch==2.11.0"])


def test_a_torch_vllm_was_not_built_for_is_an_error():
    got = {"torch": "2.13.0", "vllm": "0.33.0"}
    with pytest.raises(RuntimeError, match=r"vLLM was built for torch==2.14.0, but torch 2.13.0 is installed"):
        v.check_stack(("vllm",), get=fake(got), requires=lambda d: ["torch==2.14.0"])


def test_untested_newer_versions_warn():
    got = {"torch": "2.11.0", "megatron-core": "0.19.2", "transformer-engine": "2.11.0"}
    with pytest.warns(RuntimeWarning, match="megatron-core 0.19.2 is not the tested 0.16.1"):
        notes = v.check_stack(("megatron-core", "transformer-engine"), get=fake(got))
    assert len(notes) == 1


def test_nothing_installed_checks_nothing():
    assert v.check_stack(("vllm",), get=fake({"torch": "1.0"})) == []
