"""nanochat/metrics.py alone: console line, wandb keys, metrics.jsonl records, report curves, resume."""

import json

import pytest
import torch

from nanochat.metrics import MetricsLogger, read_metrics


class RecordingWandb:
    def __init__(self):
        self.logged, self.finished = [], False

    def log(self, d):
        self.logged.append(dict(d))

    def finish(self):
        self.finished = True


class RecordingReport:
    def __init__(self):
        self.curves = {}

    def log_curve(self, name, xs, ys, xlabel="step", ylabel=""):
        self.curves[name] = (list(xs), list(ys), ylabel)


def test_one_record_goes_everywhere(tmp_path, capsys):
    path = tmp_path / "run" / "metrics.jsonl"
    wandb = RecordingWandb()
    m = MetricsLogger(str(path), wandb)
    m.log(0, {"val/bpb": 1.5}, console="step 00000 | val bpb: 1.5000")
    m.log(1, {"train/loss": torch.tensor(2.25), "train/mfu": None, "train/lrm": 1})
    m.log(2, {"train/loss": 2.0, "train/mfu": None, "train/lrm": 1})
    assert capsys.readouterr().out == "step 00000 | val bpb: 1.5000\n"
    records = [{"step": 0, "val/bpb": 1.5}, {"step": 1, "train/loss": 2.25, "train/mfu": None, "train/lrm": 1},
               {"step": 2, "train/loss": 2.0, "train/mfu": None, "train/lrm": 1}]
    assert read_metrics(path) == records
    assert [json.loads(line) for line in path.read_text().splitlines()] == records  # one JSON object per line
    assert wandb.logged == records
    assert m.curve("train/loss") == [(1, 2.25), (2, 2.0)] and m.last("val/bpb") == 1.5 and m.curve("train/mfu") == []
    report = RecordingReport()
    m.log_curves(report, {"train/loss": ("Loss", "loss"), "val/bpb": ("Bpb", "bpb"), "rl/reward": ("R", "r")})
    assert report.curves == {"Loss": ([1, 2], [2.25, 2.0], "loss"), "Bpb": ([0], [1.5], "bpb")}  # no empty curves
    m.finish()
    assert wandb.finished


def test_fresh_run_truncates_and_resume_keeps_the_run_before_its_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    m = MetricsLogger(str(path))
    for step in range(5):
        if step % 2 == 0:
            m.log(step, {"val/bpb": 10.0 - step})
        m.log(step + 1, {"train/loss": float(step)})
    # resuming from step 2: records before step 2, and the training step that reached 2, stay; the evaluation at
    # step 2 runs again in the resumed run and is not kept twice
    resumed = MetricsLogger(str(path), resume_step=2)
    assert read_metrics(path) == [{"step": 0, "val/bpb": 10.0}, {"step": 1, "train/loss": 0.0},
                                  {"step": 2, "train/loss": 1.0}]
    assert resumed.curve("train/loss") == [(1, 0.0), (2, 1.0)]  # the report's curves cover the whole run
    resumed.log(2, {"val/bpb": 8.0})
    assert read_metrics(path)[-1] == {"step": 2, "val/bpb": 8.0}
    MetricsLogger(str(path))  # a fresh run in the same directory starts a fresh file
    assert read_metrics(path) == []


def test_resume_names_a_damaged_metrics_line_and_keeps_the_file(tmp_path):
    """A line cut short (a crash on a full disk) or without a step stops the resume with file:line, not a raw
    JSONDecodeError/KeyError, and the file is left as it was."""
    path = tmp_path / "metrics.jsonl"
    m = MetricsLogger(str(path))
    for step in range(1, 4):
        m.log(step, {"train/loss": float(step)})
    good = path.read_text()
    for bad, says in [('{"step": 4, "train/lo', r"metrics.jsonl:4 is not JSON \(.*a crash on a full disk can cut the last line short\)"),
                      ('{"steps": 4}', r"metrics.jsonl:4 is not a record with a 'step'")]:
        path.write_text(good + bad + "\n")
        with pytest.raises(ValueError, match=says + r".*Delete that line"):
            MetricsLogger(str(path), resume_step=2)
        assert path.read_text() == good + bad + "\n"
    path.write_text(good)
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]


def test_other_ranks_and_dry_runs_write_nothing(tmp_path, monkeypatch, capsys):
    path = tmp_path / "metrics.jsonl"
    wandb = RecordingWandb()
    monkeypatch.setenv("RANK", "1")
    m = MetricsLogger(str(path), wandb, master=False)
    m.log(1, {"train/loss": 3.0}, console="not printed on rank 1")
    assert not path.exists() and wandb.logged == [] and capsys.readouterr().out == ""
    assert m.curve("train/loss") == [(1, 3.0)]  # every rank keeps the curves (scripts return them)
    monkeypatch.delenv("RANK")
    dry = MetricsLogger(None, wandb)
    dry.log(1, {"train/loss": 3.0})
    assert list(tmp_path.iterdir()) == [] and wandb.logged == [{"step": 1, "train/loss": 3.0}]
