"""The test hook that holds a run after one step (fp8rl_core/loop/hold.py)."""
from __future__ import annotations

import threading
import time

import pytest

from fp8rl_core.loop.hold import ENV_VAR, hold_after, hold_spec, holders


def test_unset_or_other_steps_never_wait(tmp_path):
    assert not hold_after(3, env={})
    assert not hold_after(2, env={ENV_VAR: f"3:{tmp_path / 'never'}"})


def test_the_named_step_waits_until_the_file_appears(tmp_path):
    release = tmp_path / "go"
    done = threading.Event()
    t = threading.Thread(target=lambda: (hold_after(3, env={ENV_VAR: f"3:{release}"}, poll_s=0.01), done.set()))
    t.start()
    assert not done.wait(0.3), "the hold returned before its release file existed"
    release.touch()
    assert done.wait(30)
    t.join()


def test_the_wait_is_bounded(tmp_path):
    t0 = time.monotonic()
    assert hold_after(1, env={ENV_VAR: f"1:{tmp_path / 'never'}:0.05"}, poll_s=0.01)
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("bad", ["x:/a", "3", "3:", "3:/a:1:2"])
def test_a_malformed_value_names_the_variable_and_the_form(bad):
    with pytest.raises(ValueError, match=f"{ENV_VAR}.*<step>:<release file>"):
        hold_spec(bad)


def test_each_waiting_process_leaves_a_marker_before_it_waits(tmp_path):
    release = tmp_path / "go"
    assert holders(release) == 0
    t = threading.Thread(target=hold_after, args=(2,), kwargs={"env": {ENV_VAR: f"2:{release}"}, "poll_s": 0.01})
    t.start()
    deadline = time.monotonic() + 30
    while holders(release) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert holders(release) == 1 and t.is_alive(), "the marker must exist while the process still waits"
    release.touch()
    t.join(30)
    assert not hold_after(1, env={ENV_VAR: f"2:{release}"}) and holders(release) == 1  # other steps mark nothing
