"""environ(): variables set for a block, each put back (or removed) afterwards, even on an error."""
from __future__ import annotations

import os

import pytest

from fp8rl_core.io.environ import environ


def test_values_hold_inside_and_are_restored_after(monkeypatch):
    monkeypatch.setenv("FP8RL_T_KEPT", "before")
    monkeypatch.delenv("FP8RL_T_NEW", raising=False)
    with pytest.raises(RuntimeError):
        with environ({"FP8RL_T_KEPT": "inside", "FP8RL_T_NEW": "1"}):
            assert (os.environ["FP8RL_T_KEPT"], os.environ["FP8RL_T_NEW"]) == ("inside", "1")
            raise RuntimeError("the block fails")
    assert os.environ["FP8RL_T_KEPT"] == "before" and "FP8RL_T_NEW" not in os.environ
