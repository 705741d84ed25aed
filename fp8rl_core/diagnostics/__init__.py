"""Mismatch diagnostics: the metric catalogue (catalogue.py), worst-token tables and saved rollouts
(tokens.py, the run's hook), and the attribution replay behind `fp8rl-train explain` (explain.py; its
report and CLI are analysis/explain.py)."""
from fp8rl_core.diagnostics.catalogue import (
    CATALOGUE_METRICS,
    TAIL_METRICS,
    all_reduce_sums,
    finalize,
    partial_sums,
    reduce_with,
    step_diagnostics,
)

__all__ = ["CATALOGUE_METRICS", "TAIL_METRICS", "all_reduce_sums", "finalize", "partial_sums", "reduce_with",
           "step_diagnostics"]
