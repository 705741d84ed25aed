"""Public home of `run(cfg)`, one GRPO run (docs/design.md); the code lives in fp8rl_core/loop/run.py."""
from fp8rl_core.loop.run import RunFailed, run

__all__ = ["RunFailed", "run"]
