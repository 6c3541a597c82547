"""
One metrics path per training run: every value the loop reports goes through `MetricsLogger.log`, which

- prints the console line (rank 0),
- logs to wandb with the same namespaced keys in every stage,
- keeps each key's (step, value) list for the report's curves,
- appends one JSON object per line, step included, to `metrics.jsonl` in the run's checkpoint directory: what tests
  and tools read instead of parsing the console.

    metrics = MetricsLogger(os.path.join(checkpoint_dir, "metrics.jsonl"), wandb_run, master)
    metrics.log(step, {"val/bpb": 0.93}, console=f"step {step:05d} | val bpb: 0.9300")
    metrics.log_curves(get_report(), {"train/loss": ("Base training loss", "loss (EMA)")})
    metrics.finish()

Keys (stages use the same ones for the same thing):
    train/loss (EMA, debiased; RL: the policy-gradient loss), train/raw_loss, train/lrm, train/grad_norm,
    train/tok_per_sec, train/mfu, train/num_tokens;  val/bpb, val/loss;  eval/core_metric, eval/{task}_acc,
    eval/pass@{k};  rl/reward, rl/sequence_length.
Steps count optimizer updates: a training record at step s is the update that made s steps; an evaluation at step s
saw the model after s updates.

Only rank 0 writes (the values logged are already reduced over ranks). Each record is one write() of one line to a
file opened for appending, so a crash leaves whole lines behind. A fresh run starts a fresh file; a resumed run
(`resume_step`) keeps the records before its step and the training record of its step, and drops the rest (the
evaluations due at the resume step run again), so the file reads like one uninterrupted run. Every rank keeps the
curves (cheap, and a script may return them).
"""

import json
import math
import os

from nanochat.atomic import atomic_write
from nanochat.common import DummyWandb, print0
from nanochat.usage import BadValue


def read_metrics(path):
    """The records of a metrics.jsonl file, in order; a line that is not a record is named (file:line)."""
    records = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                record, why = None, f"is not JSON ({e}; a crash on a full disk can cut the last line short)"
            else:
                why = "is not a record with a 'step'"
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise BadValue(f"{path}:{lineno} {why}: {line.strip()[:80]!r}. Delete that line (the other records "
                                 f"are kept) and run again")
            records.append(record)
    return records


def _clean(value):
    """A JSON-friendly number: tensors and numpy scalars become floats; NaN/inf stay (json writes NaN/Infinity)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return float(value)


class MetricsLogger:
    def __init__(self, path=None, wandb_run=None, master=True, resume_step=None):
        """path: the metrics.jsonl file (None: no file, e.g. a dry run); wandb_run: a wandb run or None."""
        self.path = path if master else None
        self.wandb_run = wandb_run or DummyWandb()
        self.master = master
        self.curves = {}
        if self.path is None:
            return
        kept = []
        if resume_step is not None and os.path.exists(self.path):
            kept = [r for r in read_metrics(self.path) if r["step"] < resume_step or
                    (r["step"] == resume_step and all(k == "step" or k.startswith("train/") for k in r))]
        text = "".join(json.dumps(r) + "\n" for r in kept)
        atomic_write(self.path, lambda f: f.write(text.encode("utf-8")))
        for record in kept:
            self._add_to_curves(record)

    def _add_to_curves(self, record):
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.curves.setdefault(key, []).append((record["step"], value))

    def log(self, step, values, console=None):
        """Record `values` ({namespaced key: number or None}) at `step`; print `console` on rank 0 if given."""
        if console is not None:
            print0(console)
        record = {"step": int(step), **{k: _clean(v) for k, v in values.items()}}
        self._add_to_curves(record)
        if not self.master:
            return
        if self.path is not None:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
        self.wandb_run.log(record)

    def curve(self, key):
        """[(step, value), ...] of one key, finite values only."""
        return [(s, v) for s, v in self.curves.get(key, []) if math.isfinite(v)]

    def last(self, key, default=None):
        points = self.curves.get(key)
        return points[-1][1] if points else default

    def log_curves(self, report, specs):
        """Write the report's plots: specs = {key: (title, ylabel)}; keys with no points are left out."""
        for key, (title, ylabel) in specs.items():
            points = self.curve(key)
            if points:
                report.log_curve(title, *zip(*points), ylabel=ylabel)

    def finish(self):
        self.wandb_run.finish()
