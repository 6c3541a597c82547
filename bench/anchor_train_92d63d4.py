"""
Runs nanochat 92d63d4's own `scripts/base_train.py` unchanged (from inside its extracted copy, its nanochat first on
sys.path) and writes the training loss of every step, exactly, to a JSON-lines file: what bench/record_side_by_side.py
compares the record recipe here against.

    cd <92d63d4 copy> && python <repo>/bench/anchor_train_92d63d4.py OUT.jsonl --device-type=cpu --depth=4 ...

92d63d4 prints only the smoothed loss (an EMA, to 6 decimals). Its step line is printed through
`nanochat.common.print0` right after the step computed `train_loss_f` (the last micro-step's loss as a Python float)
in the script's module namespace, so print0 is wrapped here to read that float from the caller's globals when a step
line goes by (and `val_bpb` when an evaluation's line does). Nothing in 92d63d4's computation changes: its script runs as `python -m scripts.base_train` would run
it (compiled as it ships, unless TORCHDYNAMO_DISABLE=1 is set).

92d63d4 seeds torch with 42 in `compute_init` and has no seed flag: NANOCHAT_ANCHOR_SEED=S re-seeds torch with S right
after its `compute_init` (before it builds the model), so bench/record_quality.py can run it at more than one seed; S=42
is the run as it ships.
"""

import json
import os
import runpy
import sys

out_path, *argv = sys.argv[1:]
sys.path.insert(0, os.getcwd())  # 92d63d4's directory: its nanochat/, scripts/ and tasks/ win

import nanochat.common as common  # noqa: E402  (92d63d4's)

original_print0 = common.print0
out = open(out_path, "w")


def print0(s="", **kwargs):
    original_print0(s, **kwargs)
    caller = sys._getframe(1).f_globals
    if not isinstance(s, str) or int(os.environ.get("RANK", 0)) != 0:
        return
    if s.startswith("step ") and "train_loss_f" in caller:  # the step line, right after the step
        record = {"step": caller["step"], "loss": caller["train_loss_f"], "lrm": caller["lrm"]}
    elif s.startswith("Step ") and "Validation bpb" in s:  # an evaluation
        record = {"step": caller["step"], "val_bpb": caller["val_bpb"]}
    else:
        return
    out.write(json.dumps(record) + "\n")
    out.flush()


common.print0 = print0
if os.environ.get("NANOCHAT_ANCHOR_SEED"):
    import torch

    seed = int(os.environ["NANOCHAT_ANCHOR_SEED"])
    original_compute_init = common.compute_init

    def compute_init(*args, **kwargs):
        result = original_compute_init(*args, **kwargs)
        torch.manual_seed(seed)  # where 92d63d4 seeds 42: its model init draws from this generator next
        return result

    common.compute_init = compute_init
sys.argv = ["scripts/base_train.py", *argv]
runpy.run_module("scripts.base_train", run_name="__main__", alter_sys=True)
out.close()
