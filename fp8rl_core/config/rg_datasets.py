"""reasoning-gym's dataset registry, read at the config edge: is `task.dataset` one of its datasets, and are
`task.options` fields of that generator's config? (reasoning-gym is an optional extra and torch-free; imported
only when a config names task.name reasoning_gym.)"""
from __future__ import annotations

from typing import Any

INSTALL = "pip install 'fp8rl[real]' (or bash scripts/setup_real_model.sh)"


def registry() -> dict[str, tuple[type, type]]:
    """reasoning-gym's dataset registry: name -> (dataset class, config class); a clear error without it."""
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError as e:
        raise ImportError(f"task.name reasoning_gym needs the reasoning-gym package ({e}); {INSTALL}") from None
    return DATASETS


def check_dataset(name: str | None, options: dict[str, Any]) -> tuple[str, str, str] | None:
    """(key, problem, what is valid) when (`name`, `options`) is not a reasoning-gym dataset with valid
    generator options; None when it is. Keys are relative to `task` ("dataset", "options.<field>")."""
    datasets = registry()
    if name not in datasets:
        return "dataset", f"{name!r} is not a reasoning-gym dataset", ", ".join(sorted(datasets))
    config_cls = datasets[name][1]
    fields = [f for f in getattr(config_cls, "__dataclass_fields__", {}) if f not in ("seed", "size")]
    for key in options:
        if key not in fields:
            return f"options.{key}", f"not an option of {name}'s generator", ", ".join(fields)
    try:
        config_cls(**options, seed=0, size=1).validate()
    except (AssertionError, ValueError, TypeError) as e:
        return "options", f"{name}'s generator refuses {options}: {e or type(e).__name__}", \
            f"the fields of reasoning_gym's {config_cls.__name__}, within its own checks"
    return None
