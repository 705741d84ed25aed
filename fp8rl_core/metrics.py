"""Public home of the mismatch metric (docs/design.md); the code lives in fp8rl_core/algorithms/metrics.py."""
from fp8rl_core.algorithms.metrics import token_mult_prob_error

__all__ = ["token_mult_prob_error"]
