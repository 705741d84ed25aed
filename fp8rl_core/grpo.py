"""Public home of the GRPO functions (docs/design.md): group_advantages and importance_weights, and the
rest of fp8rl_core.algorithms.grpo's API. The code lives in fp8rl_core/algorithms/."""
from fp8rl_core.algorithms.grpo import *  # noqa: F403
from fp8rl_core.algorithms.grpo import __all__  # noqa: F401
