"""What a run is told: the run config (typed, validated at the edge), its schema helpers, YAML I/O and the
recipe table. Torch-free, so that the sweep driver can plan without importing torch.

    cfg = load_run_config("run.yaml", ["loss.importance_sampling=token"])   # a validated RunConfig
    recipe = resolve_recipe(cfg)                                             # what each engine quantizes

`fp8rl_core.config.load_run_config` and the spec classes are public; the modules are run_config.py (the
dataclasses, the table of keys `KEYS`: ranges, cell-id rules, fp8-only and native-only keys; cell-id
hashing), schema.py (dataclass <-> dict, `KeySpec`), yaml_io.py and recipe.py (the recipe; `Quantization`
is re-exported from fp8rl_core/fp8/quantization.py).
"""
from fp8rl_core.config.recipe import RECIPES, Quantization, Recipe, resolve_recipe
from fp8rl_core.config.run_config import (
    HASH_EXCLUDE,
    HASH_FP8_TRAINING_ONLY,
    HASH_IF_NOT_DEFAULT,
    KEYS,
    RANGES,
    DiagnosticsSpec,
    EngineSpec,
    Fp8Spec,
    ISVariant,
    LossSpec,
    MegatronSpec,
    MismatchGuardSpec,
    ModelSpec,
    OptimSpec,
    ParallelSpec,
    RolloutSpec,
    RunConfig,
    TaskSpec,
    TrackingSpec,
    TrainSpec,
    VllmSpec,
    WarmStartSpec,
    apply_overrides,
    hashed_dict,
    load_run_config,
    recipe_of,
    resolve_bf16_path,
    run_config_from_dict,
    run_config_hash,
    strip_unhashed,
    val_batch_rows,
)
from fp8rl_core.config.schema import ConfigError

__all__ = [
    "HASH_EXCLUDE", "HASH_FP8_TRAINING_ONLY", "HASH_IF_NOT_DEFAULT", "KEYS", "ConfigError", "DiagnosticsSpec",
    "EngineSpec",
    "Fp8Spec", "ISVariant", "LossSpec", "MegatronSpec", "MismatchGuardSpec", "ModelSpec", "OptimSpec", "ParallelSpec",
    "RolloutSpec", "RunConfig", "TaskSpec", "TrackingSpec", "TrainSpec", "VllmSpec", "WarmStartSpec", "apply_overrides",
    "hashed_dict", "load_run_config", "recipe_of", "RANGES", "resolve_bf16_path", "RECIPES", "Quantization", "Recipe",
    "resolve_recipe",
    "run_config_from_dict", "run_config_hash", "strip_unhashed", "val_batch_rows",
]
