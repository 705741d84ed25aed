"""The sweep-file schema: typed dataclasses, one source of truth for every key of `sweeps/*.yaml`.

A sweep file (YAML) has these sections (defaults in the dataclasses below):

    experiment: fp8_ablation          # name: MLflow experiment, SLURM job name, default folder
    base_config: configs/tiny.yaml    # optional run config file (relative to the sweep file)
    base: {train: {steps: 60}}        # run config (fp8rl_core.config.RunConfig), merged over base_config
    grid:                             # dotted run-config keys -> non-empty lists; product of all keys
      recipe: [bf16, fp8_gen, fp8_e2e]
      seed: [0, 1]
    zip:                              # optional groups of keys varied together (equal-length lists)
      - {optim.lr: [1e-4, 3e-4], train.steps: [80, 40]}
    exclude:                          # optional partial assignments to drop (a list matches any of it)
      - {recipe: bf16, loss.importance_sampling: token}
    launcher: {kind: local, max_parallel: 2, retries: 1, slurm: {...}}
    tracking: {uri: "sqlite:///mlflow.db"}
    search: {...}                     # optional Optuna search instead of grid/zip/exclude

Relative paths: `base_config` is relative to the sweep file; `launcher.folder`, a relative
`sqlite:///` tracking URI and a journal `search.storage` are relative to the directory `sweep` runs in.
Value checks that need the run config (grid values, search params) live in `launchers/sweepfile/keys.py`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from analysis.config import AnalysisConfig
from fp8rl_core.config.schema import ConfigError, fail
from fp8rl_core.tracking import CONTRACT_METRICS, M_VAL_ACC

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
# The MLflow contract's per-step metrics (docs/design.md, fp8rl_core.tracking): what a search may optimize.
KNOWN_METRICS = CONTRACT_METRICS
TRACKING_SCHEMES = ("sqlite", "http", "https", "postgresql", "mysql", "mssql", "databricks")
RDB_SCHEMES = ("sqlite", "postgresql", "mysql", "oracle", "mssql")
_TIME_RE = re.compile(r"^(?:(\d+)-)?(\d+):(\d{1,2}):(\d{1,2})$|^(\d+)-(\d+)$")
TIME_FORMATS = "minutes (int), 'HH:MM:SS', 'D-HH:MM:SS', 'D-HH'"
# sbatch options that have a first-class key, or that submitit itself sets for every job.
_MANAGED_SBATCH = {
    "partition": "launcher.slurm.partition", "account": "launcher.slurm.account", "qos": "launcher.slurm.qos",
    "time": "launcher.slurm.time", "nodes": "launcher.slurm.nodes", "ntasks_per_node": "launcher.slurm.tasks_per_node",
    "gpus_per_node": "launcher.slurm.gpus_per_node", "cpus_per_task": "launcher.slurm.cpus_per_task",
    "mem": "launcher.slurm.mem_gb", "job_name": "experiment", "array": "launcher.max_parallel",
    "output": "launcher.folder", "error": "launcher.folder", "signal": "launcher.slurm.signal_delay_s",
    "open_mode": None, "wrap": None,
}


class SweepError(ConfigError):
    """A sweep-file error located as `file:line` (or `command line (key=value)`)."""

    def _text(self) -> str:
        if self.key:
            return super()._text()
        head = f"{self.where}: " if self.where else ""
        return head + self.problem + (f"; valid: {self.valid}" if self.valid else "")


def slurm_minutes(value: int | str, key: str = "time") -> int:
    """SLURM time -> whole minutes (seconds round up): 90 | '01:30:00' | '1-00:00:00' | '2-12'."""
    if isinstance(value, int):
        if value < 1:
            fail(key, f"must be >= 1 minute, got {value}")
        return value
    m = _TIME_RE.match(value.strip())
    if not m:
        fail(key, f"{value!r} is not a SLURM time", TIME_FORMATS)
    days, hours, mins, secs, d2, h2 = m.groups()
    if d2 is not None:
        total_s = (int(d2) * 24 + int(h2)) * 3600
    else:
        if int(mins) > 59 or int(secs) > 59:
            fail(key, f"{value!r}: minutes and seconds must be < 60", TIME_FORMATS)
        total_s = ((int(days or 0) * 24 + int(hours)) * 60 + int(mins)) * 60 + int(secs)
    if total_s < 1:
        fail(key, f"{value!r} is zero", TIME_FORMATS)
    return -(-total_s // 60)


@dataclass
class SlurmSpec:
    partition: str | None = None  # sbatch --partition (null: the cluster's default)
    account: str | None = None  # sbatch --account
    qos: str | None = None  # sbatch --qos
    time: int | str = 60  # per job; a job that times out checkpoints and is requeued by submitit
    nodes: int = 1  # nodes per job (one job per cell)
    tasks_per_node: int = 1  # sbatch --ntasks-per-node
    gpus_per_node: int | None = None  # sbatch --gpus-per-node (null: none requested)
    cpus_per_task: int | None = None  # sbatch --cpus-per-task (null: the cluster's default)
    mem_gb: float | None = None  # memory per node in GB, sbatch --mem (null: the cluster's default)
    gpu_mem_gb: float = 80  # memory of one GPU in GB: `sweep plan` refuses a device: cuda cell whose rank cannot fit it
    signal_delay_s: int = 90  # USR2 this long before the time limit: time to finish a step and checkpoint it
    max_num_timeout: int = 3  # requeues at the time limit before the job fails (submitit's countdown)
    python: str | None = None  # command that runs python on the nodes (default: the interpreter running `sweep`)
    setup: list[str] = field(default_factory=list)  # shell lines run before the job (module load, exports)
    additional_parameters: dict[str, Any] = field(default_factory=dict)  # extra #SBATCH --key=value

    def validate(self) -> None:
        slurm_minutes(self.time)
        for name in ("nodes", "tasks_per_node", "gpus_per_node", "cpus_per_task"):
            value = getattr(self, name)
            if value is not None and value < (0 if name == "gpus_per_node" else 1):
                fail(name, f"must be >= {0 if name == 'gpus_per_node' else 1}, got {value}")
        if self.mem_gb is not None and not self.mem_gb > 0:
            fail("mem_gb", f"must be > 0, got {self.mem_gb}")
        if not self.gpu_mem_gb > 0:
            fail("gpu_mem_gb", f"must be > 0, got {self.gpu_mem_gb}")
        if self.signal_delay_s < 0:
            fail("signal_delay_s", f"must be >= 0, got {self.signal_delay_s}")
        if self.max_num_timeout < 0:
            fail("max_num_timeout", f"must be >= 0, got {self.max_num_timeout}")
        for key, value in self.additional_parameters.items():
            _check_sbatch_option(key, value)


def _check_sbatch_option(key: str, value: Any) -> None:
    where = f"additional_parameters.{key}"
    if not re.fullmatch(r"[a-z][a-z0-9_-]*", key):
        fail(where, "not an sbatch long option name", "lower-case names like mail-type, exclusive, gres")
    managed = _MANAGED_SBATCH.get(key.replace("-", "_"), "")
    if managed != "":
        fail(where, "is set by the sweep engine" + (f"; set {managed} instead" if managed else ""))
    if value is None or isinstance(value, (list, dict)) or value is False:
        fail(where, f"expected a string, a number or true, got {value!r}")


@dataclass
class LauncherSpec:
    kind: Literal["local", "slurm", "debug"] = "local"  # debug: in-process, one cell after another
    max_parallel: int = 1  # cells running at once (local processes, or the SLURM array's %limit)
    retries: int = 1  # re-runs of a FAILED/KILLED cell
    folder: str | None = None  # logs and per-cell outputs (default outputs/<experiment>); shared disk on SLURM
    # torch.distributed ranks per cell. local: each cell runs as this many processes (gloo on the CPU),
    # each taking one of max_parallel's slots; slurm: nodes x tasks_per_node (1 here means "take it
    # from slurm"; another value must equal it); debug: 1 (cells run in-process)
    ranks_per_cell: int = 1
    slurm: SlurmSpec = field(default_factory=SlurmSpec)  # used when kind is slurm

    @property
    def world_size(self) -> int:
        """Ranks of one cell: nodes x tasks_per_node on SLURM, ranks_per_cell otherwise."""
        if self.kind == "slurm":
            return self.slurm.nodes * self.slurm.tasks_per_node
        return self.ranks_per_cell

    def validate(self) -> None:
        if self.max_parallel < 1:
            fail("max_parallel", f"must be >= 1, got {self.max_parallel}")
        if self.ranks_per_cell < 1:
            fail("ranks_per_cell", f"must be >= 1, got {self.ranks_per_cell}")
        if self.kind == "debug" and self.ranks_per_cell != 1:
            fail("ranks_per_cell", f"the debug executor runs cells in-process, on one rank; got {self.ranks_per_cell}",
                 "1, or kind local/slurm")
        if self.kind == "local" and self.ranks_per_cell > self.max_parallel:
            fail("ranks_per_cell", f"a cell of {self.ranks_per_cell} ranks takes {self.ranks_per_cell} slots; "
                 f"max_parallel is {self.max_parallel}", f"max_parallel >= {self.ranks_per_cell}")
        slurm_ranks = self.slurm.nodes * self.slurm.tasks_per_node
        if self.kind == "slurm" and self.ranks_per_cell not in (1, slurm_ranks):
            fail("ranks_per_cell", f"{self.ranks_per_cell} ranks, but a SLURM cell runs on slurm.nodes x "
                 f"slurm.tasks_per_node = {slurm_ranks} tasks", f"1 or {slurm_ranks} (or change slurm.tasks_per_node)")
        if self.retries < 0:
            fail("retries", f"must be >= 0, got {self.retries}")
        if self.folder is not None and not self.folder.strip():
            fail("folder", "must not be empty")


@dataclass
class SweepTrackingSpec:
    """Where every cell of the sweep logs. The run config's own `tracking` section
    (fp8rl_core.config.TrackingSpec: uri, experiment, run ids, tags) is filled per cell by the sweep
    engine from this and from `experiment` (launchers.plan.cells.cell_run_config)."""

    uri: str = "sqlite:///mlflow.db"  # embedded default; on a cluster an MLflow server, http://host:5000

    def validate(self) -> None:
        scheme = self.uri.split("://", 1)[0] if "://" in self.uri else ""
        if scheme.split("+", 1)[0] not in TRACKING_SCHEMES:
            fail("uri", f"{self.uri!r} is not a tracking URI", "sqlite:///mlflow.db, http://host:5000, "
                 "postgresql://... (the ./mlruns file store is deprecated in MLflow 3)")


@dataclass
class SearchParamSpec:
    type: Literal["float", "int", "categorical"] | None = None  # required
    low: int | float | None = None  # float, int: lower end of the range
    high: int | float | None = None  # float, int: upper end of the range
    log: bool = False  # float, int: sample on a log scale (needs low > 0)
    step: int | float | None = None  # float, int: sample multiples of step from low (not with log)
    choices: list[Any] | None = None  # categorical: the values (null, bool, number or string)

    def validate(self) -> None:
        if self.type is None:
            fail("type", "required", "float, int, categorical")
        if self.type == "categorical":
            if self.low is not None or self.high is not None or self.log or self.step is not None:
                fail("type", "a categorical param takes choices only", "choices: [a, b, ...]")
            if not self.choices:
                fail("choices", "a categorical param needs a non-empty list")
            for c in self.choices:
                if c is not None and not isinstance(c, (bool, int, float, str)):
                    fail("choices", f"{c!r}: Optuna choices must be null, bool, number or string")
            if len({repr(c) for c in self.choices}) != len(self.choices):
                fail("choices", "a value appears twice")
            return
        self._validate_range()

    def _validate_range(self) -> None:
        if self.choices is not None:
            fail("choices", f"only for type categorical (this param is {self.type})", "low, high, log, step")
        if self.low is None or self.high is None:
            fail("low" if self.low is None else "high", f"a {self.type} param needs low and high")
        if self.type == "int":
            for name in ("low", "high", "step"):
                if getattr(self, name) is not None and not isinstance(getattr(self, name), int):
                    fail(name, f"an int param needs integers, got {getattr(self, name)!r}")
        if not self.low <= self.high or (self.type == "float" and self.low == self.high):
            fail("high", f"need low < high, got {self.low} and {self.high}")
        if self.log and self.low <= 0:
            fail("low", f"log scale needs low > 0, got {self.low}")
        if self.step is not None and (self.log or not self.step > 0):
            fail("step", "must be > 0 and cannot be combined with log")


@dataclass
class SearchSpec:
    params: dict[str, SearchParamSpec] = field(default_factory=dict)  # dotted run-config key -> range
    sampler: Literal["tpe", "random", "grid"] = "tpe"  # Optuna sampler; grid: every combination of the choices
    metric: str = M_VAL_ACC  # the trial's value: this metric's last logged value
    direction: Literal["minimize", "maximize"] = "maximize"  # whether a larger or a smaller metric is better
    n_trials: int | None = None  # required, except for sampler grid (default: the grid's size)
    parallel: int = 1  # trials running at once
    storage: str | None = None  # default: journal file <folder>/optuna.journal; or an RDB URL
    retries: int = 1  # re-runs of a failed trial
    seed: int | None = None  # sampler seed (reproducible suggestions)

    def validate(self) -> None:
        if not self.params:
            fail("params", "empty; a search needs at least one param",
                 "params: {optim.lr: {type: float, low: 1e-5, high: 1e-3, log: true}}")
        if self.metric not in KNOWN_METRICS:
            fail("metric", f"unknown metric {self.metric!r}", ", ".join(KNOWN_METRICS))
        if self.sampler == "grid":
            bad = [k for k, p in self.params.items() if p.type != "categorical"]
            if bad:
                fail(f"params.{bad[0]}.type", "the grid sampler needs categorical params (choices)")
        elif self.n_trials is None:
            fail("n_trials", f"required for sampler {self.sampler}")
        if self.n_trials is not None and self.n_trials < 1:
            fail("n_trials", f"must be >= 1, got {self.n_trials}")
        if self.parallel < 1 or self.retries < 0:
            fail("parallel" if self.parallel < 1 else "retries", "need parallel >= 1 and retries >= 0")
        if self.storage is not None:
            _check_storage(self.storage)


def _check_storage(storage: str) -> None:
    if not storage.strip():
        fail("storage", "must not be empty")
    if "://" in storage and storage.split("://", 1)[0].split("+", 1)[0] not in RDB_SCHEMES:
        fail("storage", f"{storage!r} is not an RDB URL", "a journal file path, or "
             + ", ".join(f"{s}://..." for s in RDB_SCHEMES) + " (SQLite on a shared disk locks badly)")


@dataclass
class SweepSpec:
    experiment: str = ""  # required: the sweep's name (MLflow experiment, SLURM job name, default folder)
    description: str = ""  # free text for readers (the engine does not use it)
    base_config: str | None = None  # a run-config YAML file, relative to the sweep file
    base: dict[str, Any] = field(default_factory=dict)  # run config of every cell, merged over base_config
    grid: dict[str, list[Any]] = field(default_factory=dict)  # dotted run-config key -> values; cells: the product
    zip: list[dict[str, list[Any]]] = field(default_factory=list)  # groups of keys varied together (equal lengths)
    exclude: list[dict[str, Any]] = field(default_factory=list)  # partial assignments to drop (a list: any of it)
    launcher: LauncherSpec = field(default_factory=LauncherSpec)  # how the cells run: local, SLURM or in-process
    tracking: SweepTrackingSpec = field(default_factory=SweepTrackingSpec)  # the MLflow store every cell logs to
    search: SearchSpec | None = None  # an Optuna search instead of grid/zip/exclude
    seeds: int | list[int] | None = None  # replicates of every cell: N (seeds 0..N-1) or a list; varied last
    analysis: dict[str, Any] = field(default_factory=dict)  # report statistics, instability band (keys: see below)

    def validate(self) -> None:
        if not self.experiment:
            fail("experiment", "required: the sweep's name", "letters, digits, _ . -")
        if not NAME_RE.match(self.experiment):
            fail("experiment", f"{self.experiment!r} is not a name", "letters, digits, _ . - (max 128)")
        self._validate_analysis()
        if self.search is not None:
            if self.grid or self.zip or self.exclude or self.seeds is not None:
                section = "grid" if self.grid else "zip" if self.zip else "exclude" if self.exclude else "seeds"
                fail(section, "a search sweep varies search.params only; put fixed values in base")
            return
        if not self.grid and not self.zip and self.seeds is None:
            fail("grid", "empty: a sweep varies at least one key", "grid: {recipe: [bf16, fp8_e2e]}, seeds: 4")
        self._validate_seeds()
        self._validate_axes()

    def seed_values(self) -> list[int]:
        """The `seeds` key as a list ([] when absent)."""
        if self.seeds is None:
            return []
        return list(range(self.seeds)) if isinstance(self.seeds, int) else list(self.seeds)

    def _validate_seeds(self) -> None:
        if self.seeds is None:
            return
        if isinstance(self.seeds, int) and self.seeds < 1:
            fail("seeds", f"must be >= 1, got {self.seeds}", "a count (seeds 0..N-1) or a list of seeds")
        values = self.seed_values()
        if not values or len(set(values)) != len(values):
            fail("seeds", f"expected a non-empty list of distinct seeds, got {self.seeds}")
        varied = ["grid"] * ("seed" in self.grid) + [f"zip[{i}]" for i, g in enumerate(self.zip) if "seed" in g]
        if varied:
            fail("seeds", f"seed is also varied in {varied[0]}; vary it in one place", "seeds: N, or grid.seed")

    def _validate_analysis(self) -> None:
        try:
            AnalysisConfig.from_dict(self.analysis)
        except ValueError as e:  # "analysis.<key>: <problem>"
            key, _, problem = str(e).partition(": ")
            fail(key, problem)

    def _validate_axes(self) -> None:
        owner = {}
        for key, values in self.grid.items():
            if not values:
                fail(f"grid.{key}", "empty list; give at least one value")
            owner[key] = "grid"
        for i, group in enumerate(self.zip):
            if not group:
                fail(f"zip[{i}]", "empty group", "{key_a: [...], key_b: [...]} with equal lengths")
            lengths = {k: len(v) for k, v in group.items()}
            if len(set(lengths.values())) > 1 or 0 in lengths.values():
                fail(f"zip[{i}]", f"lists must be non-empty and equally long, got {lengths}")
            for key in group:
                if key in owner:
                    fail(f"zip[{i}].{key}", f"already varied by {owner[key]}; a key is varied in one place")
                owner[key] = f"zip[{i}]"
        for i, rule in enumerate(self.exclude):
            if not isinstance(rule, dict) or not rule:
                fail(f"exclude[{i}]", "expected a non-empty mapping of varied keys to values",
                     "{recipe: bf16, loss.importance_sampling: token}")
            for key in rule:
                if key not in owner:
                    fail(f"exclude[{i}].{key}", "not a varied key", ", ".join(owner))
