"""The `fp8rl-train explain` report and CLI (analysis/explain.py) over the replay's data
(fp8rl_core/explain/replay.py): tables, figure, files, MLflow logging, the CLI's refusals, and end
to end, a tiny real run whose explain report lands in MLflow."""
from __future__ import annotations

import json
import math

import pytest

from analysis.explain import _fmt, figure, log_to_mlflow, main, markdown, write_report
from fp8rl_core.explain.attribution import VariantResult

NAN = float("nan")


def _results() -> list[VariantResult]:
    metrics = lambda m, kl, mx, frac: {"token_mult_prob_error": m, "gen_kl_error": kl,  # noqa: E731
                                       "logprob_abs_diff_max": mx, "logprob_abs_diff_frac_gt_1": frac}
    return [VariantResult("recorded", "what the run logged", metrics(1.002, 5e-6, 0.0078, NAN)),
            VariantResult("bf16", "the control", metrics(1.0, 0.0, 0.0, 0.0), [0.0, 0.0, 0.0]),
            VariantResult("kernels", "gen vs train kernels", metrics(123456.7, 1e-3, 2.5, 0.1), [1e-4, 3e-3, 2e-2])]


WORST = [{"row": 0, "position": 5, "context": "12+3=", "token": "1", "train_logprob": -0.1, "gen_logprob": -0.25,
          "abs_diff": 0.15}]


def test_fmt_dashes_missing_and_switches_to_general_format_for_large_values():
    assert [_fmt(x) for x in (None, NAN, 1.5, 12345.678)] == ["—", "—", "1.500000", "1.235e+04"]


def test_markdown_has_the_summary_the_per_layer_and_the_worst_token_tables():
    text = markdown(7, _results(), WORST)
    assert text.startswith("## Mismatch attribution, step 7\n")
    assert "| recorded | 1.002000 | 0.000005 | 0.007800 | — | — | — |" in text  # no layers measured: dashes
    assert "| bf16 | 1.000000 | 0.000000 | 0.000000 | 0.000000 | — | — |" in text  # exactly 0 everywhere
    assert "| kernels | 1.235e+05 | 0.001000 | 2.500000 | 0.100000 | 0 | 2 |" in text
    assert "| layer | bf16 | kernels |" in text and "| 2 | 0.000e+00 | 2.000e-02 |" in text
    assert "| 0 | 5 | `12+3=` | `1` | -0.1000 | -0.2500 | 0.15 |" in text
    assert text.endswith("- **kernels**: gen vs train kernels\n")
    assert "Worst tokens" not in markdown(7, _results()) and "| layer |" not in markdown(7, _results()[:1])


def test_write_report_writes_the_markdown_the_json_and_the_figure(tmp_path):
    folder = write_report(tmp_path, 7, _results(), WORST)
    assert folder == tmp_path / "diagnostics" / "explain_step_00000007"
    assert (folder / "report.md").read_text() == markdown(7, _results(), WORST)
    saved = json.loads((folder / "results.json").read_text())
    assert [v["name"] for v in saved] == ["recorded", "bf16", "kernels"]
    assert math.isnan(saved[0]["metrics"]["logprob_abs_diff_frac_gt_1"]) and saved[0]["layer_rel_err"] == []
    assert saved[2]["first_divergent_layer"] == 0 and saved[2]["largest_jump_layer"] == 2
    assert (folder / "per_layer.png").read_bytes()[:4] == b"\x89PNG"


def test_no_figure_without_per_layer_errors(tmp_path):
    assert figure(7, _results()[:1], tmp_path / "per_layer.png") is None
    assert not (tmp_path / "per_layer.png").exists()


def test_log_to_mlflow_logs_the_folder_under_the_runs_diagnostics(tmp_path, sqlite_uri):
    from types import SimpleNamespace

    from mlflow import MlflowClient

    from fp8rl_core.tracking.sink import RUN_ID_FILE

    folder = write_report(tmp_path, 3, _results())
    assert log_to_mlflow(tmp_path, SimpleNamespace(uri=sqlite_uri, run_id=None), folder) is None  # no run: nothing
    client = MlflowClient(sqlite_uri)
    exp = client.create_experiment("explain", artifact_location=(tmp_path / "artifacts").as_uri())
    run_id = client.create_run(exp).info.run_id
    (tmp_path / RUN_ID_FILE).write_text(run_id + "\n")
    assert log_to_mlflow(tmp_path, SimpleNamespace(uri=sqlite_uri, run_id=None), folder) == run_id
    logged = {a.path for a in client.list_artifacts(run_id, "diagnostics/explain_step_00000003")}
    assert logged == {f"diagnostics/explain_step_00000003/{n}" for n in ("report.md", "per_layer.png", "results.json")}


def test_explain_without_rollouts_says_what_is_missing(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "no replayable rollout" in capsys.readouterr().err
    assert main([str(tmp_path), "--variants", "bf16,nope"]) == 2
    assert "unknown variant(s) ['nope']" in capsys.readouterr().err


def test_fp8rl_train_explain_is_this_cli(tmp_path, capsys, monkeypatch):
    import analysis.explain
    from fp8rl_core.cli import main as train_main

    assert train_main(["explain", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("fp8rl-train explain: ")
    seen = []
    monkeypatch.setattr(analysis.explain, "main", lambda argv: seen.append(argv) or 0)
    assert train_main(["explain", "runs/x", "--step", "3"]) == 0 and seen == [["runs/x", "--step", "3"]]


@pytest.mark.slow
def test_tiny_run_logs_worst_tokens_and_explain_report_to_mlflow(tmp_path, capsys):
    from mlflow import MlflowClient

    from fp8rl_core.config import load_run_config
    from fp8rl_core.loop.run import run

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = tmp_path / "run"
    cfg = load_run_config(None, [
        f"output_dir={out}", f"warmstart.cache_dir={tmp_path / 'ws'}", "warmstart.steps=10",
        "warmstart.batch_size=16", "train.steps=3", "train.val_every=3", "train.checkpoint_every=2",
        "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4",
        "task.val_size=4", "threads=1", "recipe=fp8_gen", f"tracking.uri={uri}", "diagnostics.worst_tokens_k=3"])
    metrics = run(cfg, progress=False)
    assert "logprob_abs_diff_frac_gt_1" in metrics and "rollout_corr_chi2_token" in metrics
    table = [json.loads(x) for x in (out / "diagnostics" / "worst_tokens.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in table}) == [1, 2, 3] and all(len(r["prompt"]) > 0 for r in table)
    # rollouts next to the weights that generated them: step 1 (warm start) and 3 (checkpoint 2)
    assert sorted(p.name for p in (out / "rollouts").iterdir()) == ["step_00000001.pt", "step_00000003.pt"]
    client = MlflowClient(uri)
    run_id = (out / "mlflow_run_id").read_text().strip()
    assert "diagnostics/worst_tokens.jsonl" in [a.path for a in client.list_artifacts(run_id, "diagnostics")]

    assert main([str(out), "--rows", "2", "--variants", "bf16,kernels,as_run"]) == 0
    printed = capsys.readouterr().out
    assert "| bf16 | 1.000000 |" in printed and "| kernels |" in printed
    folder = out / "diagnostics" / "explain_step_00000003"
    results = {v["name"]: v for v in json.loads((folder / "results.json").read_text())}
    assert results["bf16"]["metrics"]["token_mult_prob_error"] == 1.0
    assert len(results["kernels"]["layer_rel_err"]) == 4 and (folder / "per_layer.png").stat().st_size > 0
    logged = [a.path for a in client.list_artifacts(run_id, "diagnostics/explain_step_00000003")]
    assert {"report.md", "per_layer.png", "results.json"} <= {p.rsplit("/", 1)[1] for p in logged}


def test_markdown_lists_the_other_mismatch_views_when_the_catalogue_has_them():
    from analysis.explain import VIEW_KEYS

    results = _results()
    results[1].metrics.update({"logprob_abs_diff_median": 0.25, "token_mult_prob_error_adv_pos": 1.5})
    text = markdown(7, results)
    assert "| metric | recorded | bf16 | kernels |" in text
    assert "| logprob_abs_diff_median | — | 0.250000 | — |" in text
    assert "| token_mult_prob_error_adv_pos | — | 1.500000 | — |" in text
    assert len([line for line in text.splitlines() if line.split(" | ")[0][2:] in VIEW_KEYS]) == len(VIEW_KEYS)
    assert "| metric |" not in markdown(7, _results())  # results without them: no table
