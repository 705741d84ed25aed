"""JsonlSink / MultiSink: append-only records, first-write-wins steps, torn tails, fan-out."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fp8rl_core.tracking.sink import JsonlSink, MetricSink, MultiSink, read_records


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_records_roundtrip(tmp_path):
    path = tmp_path / "m.jsonl"
    sink = JsonlSink(path)
    assert isinstance(sink, MetricSink)
    sink.log_params({"optim.lr": 2e-4, "betas": [0.9, 0.99]})
    sink.set_tags({"host": "n1", "seed": 3})
    sink.log(0, {"loss": 1.5, "val_accuracy": 0.25})
    sink.log(1, {"loss": 1.25, "bad": float("nan")})
    (tmp_path / "fig.png").write_bytes(b"x")
    sink.log_artifact(tmp_path / "fig.png", "figures")
    sink.close("FINISHED")
    recs = _lines(path)
    assert [r["kind"] for r in recs] == ["params", "tags", "metrics", "metrics", "artifact", "status"]
    assert recs[0]["values"] == {"optim.lr": 2e-4, "betas": [0.9, 0.99]}
    assert recs[1]["values"] == {"host": "n1", "seed": "3"}
    assert recs[2]["step"] == 0 and recs[2]["values"] == {"loss": 1.5, "val_accuracy": 0.25}
    assert recs[3]["values"]["loss"] == 1.25 and math.isnan(float(recs[3]["values"]["bad"]))
    assert recs[4]["path"] == str((tmp_path / "fig.png").resolve()) and recs[4]["artifact_path"] == "figures"
    assert recs[5]["status"] == "FINISHED"
    ends = [end for end, _ in read_records(path)]
    assert ends[-1] == path.stat().st_size and ends == sorted(ends)


def test_first_write_wins_across_reopen(tmp_path):
    path = tmp_path / "m.jsonl"
    sink = JsonlSink(path)
    for step in range(5):
        sink.log(step, {"loss": float(step)})
    assert sink.log(3, {"loss": 99.0, "val_accuracy": 0.5}) == {"val_accuracy": 0.5}  # new key at step 3 is fine
    sink.close(None)
    again = JsonlSink(path)  # a requeued run resumed from a checkpoint at step 2
    assert again.last_step == {"loss": 4, "val_accuracy": 3}
    written = [again.log(step, {"loss": 100.0 + step}) for step in range(3, 8)]
    assert written[:2] == [{}, {}] and written[2] == {"loss": 105.0}
    assert again.dropped == 2
    again.close()
    losses = {r["step"]: r["values"]["loss"] for r in _lines(path) if r["kind"] == "metrics" and "loss" in r["values"]}
    assert losses == {0: 0.0, 1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0, 5: 105.0, 6: 106.0, 7: 107.0}


def test_torn_tail_is_cut(tmp_path):
    path = tmp_path / "m.jsonl"
    sink = JsonlSink(path)
    sink.log(0, {"loss": 1.0})
    sink.close(None)
    with open(path, "a") as f:
        f.write('{"kind": "metrics", "step": 1, "val')  # a kill mid-write
    assert [r["step"] for _, r in read_records(path)] == [0]  # readers ignore the torn line
    sink = JsonlSink(path)
    sink.log(1, {"loss": 2.0})
    sink.close(None)
    assert [r["step"] for r in _lines(path)] == [0, 1]


@pytest.mark.parametrize("step, metrics, match", [
    (-1, {"loss": 1.0}, "step"), (1.5, {"loss": 1.0}, "step"), (True, {"loss": 1.0}, "step"),
    (0, {"loss": "high"}, "metric 'loss'"), (0, {"": 1.0}, "metric key"),
])
def test_bad_input_names_the_problem(tmp_path, step, metrics, match):
    sink = JsonlSink(tmp_path / "m.jsonl")
    with pytest.raises(TypeError, match=match):
        sink.log(step, metrics)


def test_close_rejects_unknown_status(tmp_path):
    sink = JsonlSink(tmp_path / "m.jsonl")
    with pytest.raises(ValueError, match="FINISHED"):
        sink.close("DONE")
    sink.close("RUNNING")  # the same as None: the run will be resumed
    assert not any(r["kind"] == "status" for r in _lines(tmp_path / "m.jsonl"))


class _Recorder:
    def __init__(self, fail_close: bool = False):
        self.calls, self.fail_close = [], fail_close

    def log(self, step, metrics):
        self.calls.append(("log", step, dict(metrics)))

    def log_params(self, params):
        self.calls.append(("params", dict(params)))

    def set_tags(self, tags):
        self.calls.append(("tags", dict(tags)))

    def log_artifact(self, path, artifact_path=None):
        self.calls.append(("artifact", str(path), artifact_path))

    def flush(self):
        self.calls.append(("flush",))

    def close(self, status="FINISHED"):
        self.calls.append(("close", status))
        if self.fail_close:
            raise RuntimeError("boom")


def test_multisink_fans_out_and_closes_all(tmp_path):
    a, b, c = _Recorder(), _Recorder(fail_close=True), _Recorder()
    multi = MultiSink(a, b, c)
    multi.log(2, {"loss": 1.0})
    multi.log_params({"x": 1})
    multi.set_tags({"t": "v"})
    multi.log_artifact("f.png", "figs")
    multi.flush()
    with pytest.raises(RuntimeError, match="boom"):
        multi.close("FAILED")
    expected = [("log", 2, {"loss": 1.0}), ("params", {"x": 1}), ("tags", {"t": "v"}), ("artifact", "f.png", "figs"),
                ("flush",), ("close", "FAILED")]
    assert a.calls == b.calls == c.calls == expected

