"""Sweep-file schema and loader: the repo's sweep files, the corpus of bad files, overrides, fuzzing."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fp8rl_core.config.schema import ConfigError
from launchers.executors.slurm.sbatch import slurm_submission
from launchers.plan.grid import expand_grid
from launchers.sweepfile.loading import load_sweep, load_sweep_text
from launchers.sweepfile.schema import SweepError, slurm_minutes

REPO = Path(__file__).resolve().parents[2]
SWEEPS = sorted((REPO / "sweeps").glob("*.yaml"))
BAD = sorted(p for p in (Path(__file__).parent / "bad_sweeps").glob("*.yaml") if not p.name.startswith("_"))
GRID = "experiment: t\ngrid:\n  recipe: [bf16, fp8_e2e]\n  seed: [0, 1]\n"


def load_and_expand(path_or_text, **kw):
    if isinstance(path_or_text, Path):
        sweep = load_sweep(path_or_text, **kw)
    else:
        sweep = load_sweep_text(path_or_text, "t.yaml", **kw)
    return sweep, (expand_grid(sweep).cells if sweep.spec.search is None else [])


def test_the_study_sweep_files_exist():
    names = {p.name for p in SWEEPS}
    assert {"fp8_ablation.yaml", "smoke.yaml", "lr_search.yaml", "fp8_ablation_llama8b.yaml"} <= names


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.name)
def test_repo_sweep_files_validate(path):
    sweep, cells = load_and_expand(path)
    assert sweep.experiment == path.stem
    if sweep.spec.search is None:
        assert cells and len({c.id for c in cells}) == len(cells)
    if sweep.launcher.kind == "slurm":
        slurm_submission(sweep)


def test_study_grids_are_recipes_by_is_by_seeds():
    seeds = {"fp8_ablation.yaml": range(7), "smoke.yaml": range(2), "fp8_ablation_llama8b.yaml": range(2)}
    for name, replicates in seeds.items():
        sweep, cells = load_and_expand(REPO / "sweeps" / name)
        got = {(c.config.recipe, c.config.loss.importance_sampling, c.config.seed) for c in cells}
        assert got == {(r, i, s) for r in ("bf16", "fp8_gen", "fp8_e2e") for i in ("none", "token") for s in replicates}
    study, cells = load_and_expand(REPO / "sweeps" / "fp8_ablation.yaml")
    assert (study.launcher.kind, study.launcher.max_parallel, study.spec.tracking.uri) == ("local", 2, "sqlite:///mlflow.db")
    # the zero-mismatch floor: every recipe x seed once more with matched kernels, without IS
    matched = {(c.config.recipe, c.config.loss.importance_sampling, c.config.seed) for c in cells
               if c.config.engines.kernels == "matched"}
    assert matched == {(r, "none", s) for r in ("bf16", "fp8_gen", "fp8_e2e") for s in range(7)}
    # BF16 as the recipe says, on every CPU: no FP32 baseline, the path chosen by the machine
    assert {(c.config.model.dtype, c.config.model.bf16_compute) for c in cells} == {("bf16", "auto")}
    assert study.spec.analysis["accuracy_metric"] == "val_accuracy_bf16_eval"  # declared before the study ran


def test_llama8b_mirrors_nemo_rl():
    sweep, cells = load_and_expand(REPO / "sweeps" / "fp8_ablation_llama8b.yaml")
    cfg = cells[0].config
    assert (cfg.rollout.prompts_per_step, cfg.rollout.samples_per_prompt) == (64, 32)
    assert (cfg.optim.lr, cfg.rollout.temperature, cfg.train.val_every) == (3e-7, 1.0, 10)
    # native FSDP2 training: the Megatron engine is still one replica per rank (docs/design.md "GPU backends")
    assert (cfg.engines.generation, cfg.engines.training) == ("vllm", "native")
    assert cfg.model.path and cfg.task.name == "jsonl"
    assert sweep.launcher.kind == "slurm" and sweep.launcher.slurm.gpus_per_node == 8


def test_lr_search_is_an_optuna_search_over_lr_and_cap():
    sweep, _ = load_and_expand(REPO / "sweeps" / "lr_search.yaml")
    search = sweep.spec.search
    assert set(search.params) == {"optim.lr", "loss.is_cap"} and search.params["optim.lr"].log
    assert (sweep.base_config.recipe, sweep.base_config.loss.importance_sampling) == ("fp8_e2e", "tis")


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.name)
def test_bad_sweep_corpus(path):
    """Line 1 of each bad file: `# error: <fragment of the expected message>`."""
    expected = path.read_text().splitlines()[0].removeprefix("# error: ").strip()
    with pytest.raises(SweepError) as info:
        load_and_expand(path)
    assert expected in str(info.value)
    located = path.parent / "_run_config_bad.yaml" if path.name == "base_config_bad_value.yaml" else path
    assert str(info.value).startswith(str(located))  # located in the file (or the base_config it names)


def test_corpus_is_big_enough():
    assert len(BAD) >= 30


@pytest.mark.parametrize("value, minutes", [(90, 90), ("01:30:00", 90), ("1-00:00:00", 1440), ("2-12", 3600),
                                            ("00:00:30", 1), ("0-00:01:01", 2), ("48:00:00", 2880)])
def test_slurm_minutes(value, minutes):
    assert slurm_minutes(value) == minutes


@pytest.mark.parametrize("value", ["4h", "1:60:00", 0, "00:00:00", "", "1-2-3"])
def test_slurm_minutes_rejects(value):
    with pytest.raises(ConfigError, match="time"):
        slurm_minutes(value)


def test_base60_and_dotless_floats_read_as_intended():
    """YAML 1.1 reads 4:00:00 as 14400 and 1e-4 as a string; the sweep loader does not."""
    sweep = load_sweep_text(GRID.replace("seed: [0, 1]", "optim.lr: [1e-4, 3e-4]") +
                            "launcher: {kind: slurm, slurm: {time: 4:00:00}}\n", "t.yaml")
    assert slurm_minutes(sweep.launcher.slurm.time) == 240
    assert [a.values for a in sweep.axes if a.key == "optim.lr"] == [(1e-4, 3e-4)]
    assert yaml.safe_load("t: 4:00:00")["t"] == 14400  # the trap being avoided


def test_nested_grid_keys_mean_dotted_keys():
    nested = load_sweep_text("experiment: t\ngrid:\n  loss:\n    importance_sampling: [none, tis]\n"
                             "exclude:\n  - loss: {importance_sampling: tis}\n", "t.yaml")
    assert [(a.key, a.values) for a in nested.axes] == [("loss.importance_sampling", ("none", "tis"))]
    assert [c.params for c in expand_grid(nested).cells] == [{"loss.importance_sampling": "none"}]
    with pytest.raises(SweepError, match=r"t.yaml:4: grid.loss.importance_sampling\[1\]: 'tokn' is not allowed"):
        load_sweep_text("experiment: t\ngrid:\n  loss:\n    importance_sampling: [none, tokn]\n", "t.yaml")


def test_base_config_relative_to_sweep_file_and_inline_base_wins(tmp_path):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "run.yaml").write_text("train: {steps: 7, val_every: 2}\nloss: {is_cap: 3}\n")
    (tmp_path / "s.yaml").write_text("experiment: t\nbase_config: configs/run.yaml\nbase:\n  train: {steps: 9}\n"
                                     "grid: {seed: [0]}\n")
    sweep = load_sweep(tmp_path / "s.yaml", ["base.loss.is_cap=4"])
    assert (sweep.base_config.train.steps, sweep.base_config.train.val_every) == (9, 2)
    assert sweep.base_config.loss.is_cap == 4.0


@pytest.mark.parametrize("overrides, check", [
    (["launcher=slurm", "max_parallel=8", "retries=0"],
     lambda s: (s.launcher.kind, s.launcher.max_parallel, s.launcher.retries) == ("slurm", 8, 0)),
    (["launcher.slurm.time=4:00:00"], lambda s: slurm_minutes(s.launcher.slurm.time) == 240),
    (["grid.loss.importance_sampling=[none, tis]"],
     lambda s: [a.values for a in s.axes if a.key == "loss.importance_sampling"] == [("none", "tis")]),
    (["base.train.steps=5", "folder=/tmp/x"], lambda s: s.base_config.train.steps == 5 and str(s.folder) == "/tmp/x"),
    (["tracking.uri=http://host:5000"], lambda s: s.tracking_uri() == "http://host:5000"),
])
def test_overrides(overrides, check):
    assert check(load_sweep_text(GRID, "t.yaml", overrides))


def test_search_param_override_sets_one_field():
    text = (REPO / "sweeps" / "lr_search.yaml").read_text()
    sweep = load_sweep_text(text, "lr.yaml", ["search.params.optim.lr.low=1e-6", "search.n_trials=3"])
    assert sweep.spec.search.params["optim.lr"].low == 1e-6 and sweep.spec.search.n_trials == 3


@pytest.mark.parametrize("override, fragment", [
    ("max_parallel=0", "command line (max_parallel=0): launcher.max_parallel: must be >= 1"),
    ("base.train.stepz=1", "command line (base.train.stepz=1): base.train.stepz: unknown key"),
    ("grid.seed=[0, 1", "command line (grid.seed=[0, 1): grid.seed: not a valid YAML value"),
    ("exclude.0.seed=1", "exclude is a list: override it whole"),
    ("nonsense", "an override must read key=value"),
    ("grid.recipe=[fp16]", "command line (grid.recipe=[fp16]): grid.recipe[0]: unknown recipe"),
    ("experiment.name=x", "experiment.name: cannot set it: experiment is str, not a mapping"),
])
def test_override_errors_name_the_command_line(override, fragment):
    with pytest.raises(SweepError) as info:
        load_sweep_text(GRID, "t.yaml", [override])
    assert fragment in str(info.value)


def test_tracking_uri_resolves_relative_sqlite_against_cwd(tmp_path):
    sweep = load_sweep_text(GRID, "t.yaml", cwd=tmp_path)
    assert sweep.tracking_uri() == f"sqlite:///{tmp_path}/mlflow.db"
    assert sweep.folder == tmp_path / "outputs" / "t"


def test_loading_has_no_side_effect(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for path in SWEEPS:
        load_and_expand(path)
    assert list(tmp_path.iterdir()) == []


def test_slurm_parameter_names_are_submitits():
    """One source of truth: every parameter we pass is a parameter of submitit's sbatch writer."""
    from submitit.slurm.slurm import _get_default_parameters

    sweep = load_sweep(REPO / "sweeps" / "fp8_ablation_llama8b.yaml")
    assert set(slurm_submission(sweep).parameters) <= set(_get_default_parameters())


def test_optuna_distributions_match_the_params():
    from optuna.distributions import FloatDistribution

    from launchers.run.search import optuna_distributions

    sweep = load_sweep(REPO / "sweeps" / "lr_search.yaml", cwd=Path("/work"))
    dists = optuna_distributions(sweep.spec.search)
    assert dists["optim.lr"] == FloatDistribution(1e-5, 1e-3, log=True)
    assert sweep.study_storage() == "/work/outputs/lr_search/optuna.journal"


# ---- fuzzing: whatever the YAML, loading ends in a value or a clean ConfigError ----

KEYS = ["experiment", "base", "grid", "zip", "exclude", "launcher", "tracking", "search", "base_config",
        "kind", "max_parallel", "slurm", "time", "seed", "recipe", "loss.importance_sampling", "optim.lr",
        "params", "type", "low", "high", "choices", "uri", "train", "steps", "additional_parameters", "x"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 10**6), st.floats(allow_nan=True),
                    st.sampled_from(["bf16", "fp8_e2e", "token", "none", "slurm", "float", "4:00:00", "", "a b"]),
                    st.text(max_size=8))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.sampled_from(KEYS), inner, max_size=4)),
                      max_leaves=12)
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _only_config_errors(text: str, overrides=()) -> None:
    try:
        load_and_expand(text, overrides=list(overrides))
    except ConfigError as e:
        assert str(e)  # a message, not a crash


@FUZZ
@given(st.dictionaries(st.sampled_from(KEYS), values, max_size=6))
def test_fuzz_structures(data):
    _only_config_errors(yaml.safe_dump(data))


@FUZZ
@given(st.text(alphabet=st.sampled_from(list("ab:-[]{}&*!|>'\"#%@`,? \n\t01.e")), max_size=60))
def test_fuzz_text(text):
    _only_config_errors(text)


@FUZZ
@given(st.sampled_from(["experiment", "grid", "launcher", "base", "tracking", "grid.seed", "launcher.kind",
                        "base.train.steps", "search.params.optim.lr.low", "max_parallel", "launcher.slurm.time"]),
       values)
def test_fuzz_overrides_on_a_valid_file(key, value):
    _only_config_errors(GRID, [f"{key}={yaml.safe_dump(value, default_flow_style=True).strip()}"])


MUTABLE = ["experiment", "base.train.steps", "base.task.digits", "base.loss", "grid.recipe", "grid.seed",
           "grid.task.min_digits", "grid.task.digits", "grid.optim.betas", "grid.task.operators", "zip",
           "exclude", "launcher.kind", "launcher.slurm", "launcher.slurm.time", "launcher.slurm.mem_gb",
           "launcher.slurm.additional_parameters", "tracking.uri", "search", "search.params", "base_config"]


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(MUTABLE), values), min_size=1, max_size=3))
def test_fuzz_mutations_of_the_smoke_sweep(edits):
    """Near-valid files reach the deep checks (typing, expansion, ids); still only ConfigErrors."""
    data = yaml.safe_load((REPO / "sweeps" / "smoke.yaml").read_text())
    for key, value in edits:
        head, _, rest = key.partition(".")
        if head == "grid" and rest:
            data.setdefault("grid", {})[rest] = value
            continue
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {}) if isinstance(node.get(part), dict) or part not in node else {}
        node[parts[-1]] = value
    _only_config_errors(yaml.safe_dump(data))


def test_one_yaml_dialect_for_run_configs_and_sweep_files(tmp_path):
    """`fp8rl-train cfg.yaml` and a sweep's base_config read the same file the same way (fp8rl_core.config.yaml_io)."""
    from fp8rl_core.config import load_run_config
    from fp8rl_core.config.schema import ConfigError
    from fp8rl_core.config.yaml_io import load_mapping_file

    dup = tmp_path / "dup.yaml"
    dup.write_text("train:\n  steps: 3\n  steps: 4\n")
    with pytest.raises(ConfigError) as run_err:
        load_run_config(dup)
    assert str(run_err.value) == f"{dup}:3: train.steps: duplicate key (first on line 2)"  # its real key, not `yaml`
    (tmp_path / "s.yaml").write_text("experiment: t\nbase_config: dup.yaml\ngrid: {seed: [0, 1]}\n")
    with pytest.raises(SweepError) as sweep_err:
        load_sweep(tmp_path / "s.yaml")
    text = str(sweep_err.value)
    assert "train.steps: duplicate key (first on line 2)" in text and ": yaml:" not in text
    (tmp_path / "t.yaml").write_text("tracking: {tags: {limit: 4:00:00}}\n")
    assert load_mapping_file(tmp_path / "t.yaml") == {"tracking": {"tags": {"limit": "4:00:00"}}}  # not 14400
    assert load_run_config(tmp_path / "t.yaml", ["tracking.tags.limit=4:00:00"]).tracking.tags["limit"] == "4:00:00"


@pytest.mark.parametrize("seeds, expected", [("3", [0, 1, 2]), ("[7, 2]", [7, 2])])
def test_seeds_replicate_every_cell_and_vary_fastest(seeds, expected):
    sweep, cells = load_and_expand(f"experiment: t\ngrid:\n  recipe: [bf16, fp8_e2e]\nseeds: {seeds}\n")
    assert [(c.config.recipe, c.config.seed) for c in cells] == [(r, s) for r in ("bf16", "fp8_e2e") for s in expected]
    written, _ = load_and_expand(f"experiment: t\ngrid:\n  recipe: [bf16, fp8_e2e]\n  seed: {expected}\n")
    assert [c.id for c in cells] == [c.id for c in expand_grid(written).cells]  # the same cells, the same ids


@pytest.mark.parametrize("text, fragment", [
    ("grid:\n  seed: [0, 1]\nseeds: 2\n", "seeds: seed is also varied in grid"),
    ("seeds: 0\n", "seeds: must be >= 1"),
    ("seeds: [1, 1]\n", "seeds: expected a non-empty list of distinct seeds"),
    ("seeds: 2\nanalysis: {equivalence_margin: -1}\n", "analysis.equivalence_margin"),
    ("seeds: 2\nanalysis: {margin: 2}\n", "analysis.margin: unknown key"),
    ("seeds: 2\nanalysis:\n  episodes: {mismatch_above: 0.9}\n", "t.yaml:4: analysis.episodes.mismatch_above: 0.9 "
                                                                 "is invalid; expected a ratio above 1"),
    ("seeds: 2\nanalysis:\n  episodes:\n    accuracy_drops: 5\n", "t.yaml:5: analysis.episodes.accuracy_drops: "
                                                                  "unknown key; valid keys are: mismatch_above"),
])
def test_bad_seeds_and_analysis_keys_name_the_key(text, fragment):
    with pytest.raises(SweepError, match=fragment.replace("[", r"\[")) as e:
        load_sweep_text("experiment: t\n" + text, "t.yaml")
    assert "t.yaml:" in str(e.value)


def test_seeds_alone_make_a_sweep_and_analysis_reaches_the_report_config():
    from analysis.config import AnalysisConfig

    sweep, cells = load_and_expand("experiment: t\nseeds: 2\nanalysis: {equivalence_margin: 3}\n")
    assert [c.config.seed for c in cells] == [0, 1]
    assert AnalysisConfig.from_dict(sweep.spec.analysis).equivalence_margin == 3.0
