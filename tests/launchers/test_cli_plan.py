"""`sweep plan`: the text (golden files), states/actions, exit codes, no side effects, and the sbatch
preview against what submitit really writes (through submitit's mocked sbatch).

Golden files live in tests/launchers/golden/; regenerate them with
    UPDATE_GOLDEN=1 python -m pytest tests/launchers/test_cli_plan.py -q
and review the diff: a changed cell id means the run config (or its defaults) changed.
"""
from __future__ import annotations

import difflib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launchers import cli
from launchers.executors.slurm.sbatch import render_sbatch, slurm_submission
from launchers.plan.grid import expand_grid
from launchers.plan.render import action_for, render_plan
from launchers.sweepfile.loading import load_sweep, load_sweep_text

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"
FAKE_CWD = Path("/CWD")  # the llama8b golden is rendered as if `sweep` ran in /CWD


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(text)
        return
    assert path.exists(), f"{path} is missing: run with UPDATE_GOLDEN=1 to create it"
    expected = path.read_text()
    diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True), "golden", "now"))
    assert text == expected, f"{name} differs from the golden file (UPDATE_GOLDEN=1 to accept):\n{diff}"


def stable(text: str) -> str:
    """The interpreter's path is machine-specific: replace it by a placeholder."""
    return text.replace(sys.executable, "<python>")


def test_golden_smoke_plan(monkeypatch):
    # mem/rank depends on the BF16 path that model.bf16_compute auto resolves to on the planning CPU (the
    # emulation's FP32 upcasts cost more): the golden text is an AVX2-only CPU's, whatever CPU runs the test
    monkeypatch.setattr("fp8rl_core.model.bf16.cpu_flags", lambda: frozenset({"avx2"}))
    monkeypatch.chdir(REPO)
    sweep = load_sweep("sweeps/smoke.yaml")
    text = render_plan(sweep, expand_grid(sweep), provider=lambda ids: {})
    check_golden("smoke_plan.txt", text)


def test_golden_llama8b_sbatch():
    sweep = load_sweep(REPO / "sweeps" / "fp8_ablation_llama8b.yaml", cwd=FAKE_CWD)
    text = render_sbatch(slurm_submission(sweep), len(expand_grid(sweep).cells))
    assert "#SBATCH --array=0-11%12" in text and "#SBATCH --gpus-per-node=8" in text
    check_golden("fp8_ablation_llama8b_sbatch.txt", stable(text))


def _submit(x: int) -> int:
    return x


@pytest.mark.parametrize("n_cells", [1, 5])
def test_preview_equals_what_submitit_submits(tmp_path, n_cells):
    """Submit through submitit's own SlurmExecutor (sbatch mocked by submitit's test helper) and
    compare the sbatch file it wrote with the preview."""
    from submitit.slurm.slurm import SlurmExecutor
    from submitit.slurm.test_slurm import mocked_slurm

    sweep = load_sweep(REPO / "sweeps" / "fp8_ablation_llama8b.yaml", cwd=tmp_path)
    sub = slurm_submission(sweep)
    with mocked_slurm():
        executor = SlurmExecutor(folder=sub.folder, python=sub.python)
        executor.update_parameters(**sub.parameters)
        executor.map_array(_submit, list(range(n_cells)))
    written = list(tmp_path.rglob("*_submission.sh"))
    assert len(written) == 1
    assert written[0].read_text() == render_sbatch(sub, n_cells)


def run_cli(args, capsys):
    rc = cli.main(args)
    out, err = capsys.readouterr()
    return rc, out, err


def test_plan_prints_cells_counts_and_creates_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    shutil.copy(REPO / "sweeps" / "smoke.yaml", tmp_path / "smoke.yaml")
    rc, out, _ = run_cli(["plan", "smoke.yaml"], capsys)
    assert rc == 0 and "cells: 12 (12 combinations, 0 excluded)" in out and "actions: run 12" in out
    assert "sbatch" not in out
    rc, out, _ = run_cli(["plan", "smoke.yaml", "launcher=slurm", "max_parallel=3"], capsys)
    assert rc == 0 and "#SBATCH --array=0-11%3" in out and "#SBATCH --mem=2GB" in out
    for name in ("fp8_ablation_llama8b.yaml", "lr_search.yaml"):
        assert run_cli(["plan", str(REPO / "sweeps" / name)], capsys)[0] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smoke.yaml"]  # no folder, no mlflow.db


def test_states_drive_actions_and_the_sbatch_array(capsys):
    sweep = load_sweep_text((REPO / "sweeps" / "smoke.yaml").read_text(), "smoke.yaml", ["launcher=slurm"])
    exp = expand_grid(sweep)
    ids = [c.id for c in exp.cells]
    states = {ids[0]: "FINISHED", ids[1]: "FAILED", ids[2]: "RUNNING", ids[3]: "KILLED"}
    text = render_plan(sweep, exp, provider=lambda asked: {i: states[i] for i in asked if i in states})
    assert f"{ids[0]}  bf16" in text
    assert "actions: rerun 2, run 8, skip 1, wait 1" in text
    assert "states: FAILED 1, FINISHED 1, KILLED 1, RUNNING 1, new 8" in text
    assert "#SBATCH --array=0-9%2" in text  # 10 cells to (re)run
    done = render_plan(sweep, exp, provider=lambda asked: {i: "FINISHED" for i in asked})
    assert "nothing to submit" in done and "#SBATCH" not in done


@pytest.mark.parametrize("state, action", [("new", "run"), ("unknown", "run"), ("FINISHED", "skip"),
                                           ("failed", "rerun"), ("KILLED", "rerun"), ("RUNNING", "wait"),
                                           ("exhausted", "skip (retries used up)"), ("weird", "?")])
def test_action_for(state, action):
    assert action_for(state) == action


def test_default_states_new_without_a_store_unknown_with_one(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.yaml").write_text("experiment: t\ngrid: {seed: [0, 1]}\n")
    assert "states: new 2" in run_cli(["plan", "s.yaml"], capsys)[1]
    (tmp_path / "mlflow.db").write_bytes(b"")
    assert "states: unknown 2" in run_cli(["plan", "s.yaml"], capsys)[1]


def test_long_tables_are_cut_unless_all(tmp_path, capsys):
    path = tmp_path / "big.yaml"
    path.write_text("experiment: big\ngrid: {seed: " + str(list(range(250))) + "}\n")
    out = run_cli(["plan", str(path)], capsys)[1]
    assert "... and 50 more cells" in out and "cells: 250" in out
    out = run_cli(["plan", str(path), "--all"], capsys)[1]
    assert "more cells" not in out and len([ln for ln in out.splitlines() if ln.endswith("new    run")]) == 250


def test_search_plan_lists_params_and_trials(capsys):
    rc, out, _ = run_cli(["plan", str(REPO / "sweeps" / "lr_search.yaml"), "launcher=slurm"], capsys)
    assert rc == 0
    assert "tpe sampler, 12 trials, 2 at once, maximize val_accuracy" in out
    assert "optim.lr     float [1e-05, 0.001] log" in out and "#SBATCH --array=0-1%2" in out


def test_bad_file_exits_2_with_location(capsys):
    bad = Path(__file__).parent / "bad_sweeps" / "unknown_recipe.yaml"
    rc, out, err = run_cli(["plan", str(bad)], capsys)
    assert rc == 2 and out == ""
    assert err.startswith(f"error: {bad}:6: grid.recipe[1]: unknown recipe 'fp16'; valid: bf16, fp8_gen, fp8_e2e")
    rc, _, err = run_cli(["plan", str(REPO / "sweeps" / "smoke.yaml"), "max_parallel=0"], capsys)
    assert rc == 2 and "command line (max_parallel=0): launcher.max_parallel: must be >= 1" in err
    rc, _, err = run_cli(["plan", "no/such/file.yaml"], capsys)
    assert rc == 2 and "no/such/file.yaml: cannot read the sweep file" in err




def test_module_entry_point_exit_code(tmp_path):
    bad = Path(__file__).parent / "bad_sweeps" / "empty_grid.yaml"
    proc = subprocess.run([sys.executable, "-m", "launchers.cli", "plan", str(bad)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "grid: empty" in proc.stderr
