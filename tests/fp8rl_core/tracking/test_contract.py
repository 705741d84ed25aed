"""The MLflow contract (fp8rl_core/tracking/contract.py) is what a real run logs: a tiny run's step and
validation metrics, read back from MLflow, cover the names the contract declares."""
from __future__ import annotations

from mlflow import MlflowClient

from fp8rl_core.config import load_run_config
from fp8rl_core.loop.run import run
from fp8rl_core.tracking import contract
from fp8rl_core.tracking.sink import RUN_ID_FILE
from launchers.sweepfile.schema import KNOWN_METRICS


def test_the_contract_declares_each_metric_once_and_the_search_knows_them():
    declared = (*contract.STEP_METRICS, *contract.VALIDATION_METRICS)
    assert len(set(declared)) == len(declared)
    assert set(contract.CONTRACT_METRICS) <= set(declared)
    assert KNOWN_METRICS == contract.CONTRACT_METRICS


def test_a_real_run_logs_every_contract_metric_at_its_steps(tmp_path, sqlite_uri):
    cfg = load_run_config(None, [
        f"output_dir={tmp_path / 'run'}", "warmstart.steps=0", "train.steps=2", "train.val_every=2",
        "train.checkpoint_every=2", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
        "rollout.max_new_tokens=4", "task.val_size=4", "threads=1", f"tracking.uri={sqlite_uri}"])
    run(cfg, progress=False)
    run_id = (tmp_path / "run" / RUN_ID_FILE).read_text().strip()
    client = MlflowClient(sqlite_uri)
    logged = {key: {m.step for m in client.get_metric_history(run_id, key)}
              for key in (*contract.STEP_METRICS, *contract.VALIDATION_METRICS)}
    for key in contract.STEP_METRICS:  # every training step
        assert logged[key] == {1, 2}, key
    for key in contract.VALIDATION_METRICS:  # step 0 (before training) and every val_every
        assert logged[key] == {0, 2}, key
    assert client.get_run(run_id).info.status == contract.FINISHED
    tags = client.get_run(run_id).data.tags
    assert tags[contract.TAG_WORLD_SIZE] == "1"
    # how the FP8 GEMM executor was chosen (fp8/choice.py; the tests run with the calibration off)
    assert tags[contract.TAG_FP8_GEMM_CHOICE] == "default: not measured, $FP8RL_GEMM_CALIBRATE=0"
