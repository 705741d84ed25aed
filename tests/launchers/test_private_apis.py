"""The private submitit and MLflow APIs we call, pinned: a change in either package fails here, loudly,
with the name that moved (pyproject.toml bounds both packages; widen a bound only with this test green).

- submitit: `submitit.slurm.slurm._make_sbatch_string`, `_convert_mem`, `_get_default_parameters`,
  `SlurmExecutor._submitit_command_str` (launchers/executors/slurm/sbatch.py renders the exact sbatch
  file submitit writes), the local controller module `submitit.local._local`
  and `LocalJob._process` (launchers/executors/local.py recognises and polls its processes),
  `Job._interrupt` (tests simulate preemption);
- MLflow: `RunData._metric_objs` (fp8rl_core/tracking/mlflow_sink.py: each key's last step),
  `MlflowClient._tracking_client.store`, `SqlAlchemyStore.get_metric_history_bulk`,
  `RestStore.get_host_creds`, `mlflow.utils.rest_utils.http_request_safe` (fp8rl_core/tracking/store.py's bulk
  history reads).
"""
from __future__ import annotations

import importlib
import inspect

import pytest


def _param_names(fn) -> set[str]:
    return set(inspect.signature(fn).parameters)


def test_submitit_private_names_exist_with_the_signatures_we_call():
    slurm = importlib.import_module("submitit.slurm.slurm")
    for name in ("_make_sbatch_string", "_convert_mem", "_get_default_parameters"):
        assert callable(getattr(slurm, name, None)), f"submitit.slurm.slurm.{name} is gone (launchers/executors/slurm)"
    params = _param_names(slurm._make_sbatch_string)
    assert {"command", "folder", "map_count", "array_parallelism", "signal_delay_s", "additional_parameters",
            "setup"} <= params, f"_make_sbatch_string's parameters changed: {sorted(params)}"
    assert isinstance(inspect.getattr_static(slurm.SlurmExecutor, "_submitit_command_str"), property)
    assert slurm._convert_mem(2.0) == "2GB"
    importlib.import_module("submitit.local._local")  # launchers/executors/local.py CONTROLLER_MODULE
    submitit = importlib.import_module("submitit")
    assert callable(getattr(submitit.SlurmJob, "_interrupt", None))
    local = importlib.import_module("submitit.local.local")
    assert "_process" in inspect.getsource(local.LocalJob.__init__), "LocalJob._process is gone (executors/local.py)"


def test_submitit_version_is_within_the_bound():
    import submitit

    major, minor = (int(x) for x in submitit.__version__.split(".")[:2])
    assert (major, minor) == (1, 5), f"submitit {submitit.__version__}: pyproject bounds it to 1.5.x"


def test_mlflow_private_names_exist_with_the_signatures_we_call(tmp_path):
    from mlflow import MlflowClient
    from mlflow.store.tracking.rest_store import RestStore
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
    from mlflow.utils import rest_utils

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    store = client._tracking_client.store
    assert isinstance(store, SqlAlchemyStore)
    params = _param_names(SqlAlchemyStore.get_metric_history_bulk)
    assert {"run_ids", "metric_key", "max_results"} <= params, f"get_metric_history_bulk changed: {sorted(params)}"
    assert callable(RestStore(lambda: None).get_host_creds), "RestStore no longer keeps get_host_creds"
    from mlflow.entities import Metric, RunData

    data = RunData(metrics=[Metric("loss", 0.5, 0, 7)])
    assert [(m.key, m.step) for m in data._metric_objs] == [("loss", 7)], "RunData._metric_objs changed"
    assert callable(getattr(rest_utils, "http_request_safe", None))


def test_mlflow_major_version_is_within_the_bound():
    import mlflow

    assert int(mlflow.__version__.split(".")[0]) == 3, f"mlflow {mlflow.__version__}: pyproject bounds it to 3.x"


@pytest.mark.parametrize("module", ["submitit", "mlflow"])
def test_the_bounds_are_declared(module):
    from pathlib import Path

    import tomllib

    deps = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = next(d for d in deps if d.startswith(module))
    assert "<" in spec, f"{spec}: an upper bound is required (we call private APIs)"
