"""
Evaluate a base model on the CORE metric (DCLM's 22 in-context-learning tasks, centered accuracy).

    python -m scripts.base_eval                                   # latest base checkpoint, full CORE
    torchrun --nproc_per_node=8 -m scripts.base_eval              # same, examples split over 8 GPUs
    python -m scripts.base_eval --max_per_task=100 --device_type=cpu --bundle_dir=../shared/data/core_eval

Data: --bundle_dir, else $NANOCHAT_DATA_DIR/core_eval, else <base_dir>/eval_bundle, else it downloads nanochat's
eval_bundle.zip there. Writes <base_dir>/base_eval/<model>.csv and the "Base model evaluation" report section.
"""

import contextlib
import csv
import io
import os

import torch

from nanochat.atomic import atomic_write
from nanochat.common import (
    autodetect_device_type, compute_cleanup, compute_init, device_type_flag, get_base_dir, print0
)
from nanochat.configurator import Flag, Flags
from nanochat.core_eval import evaluate_model, get_bundle_dir


def write_results_csv(path, out):
    """Task, Accuracy, Centered per task (missing tasks with empty values and a note), then the CORE row."""
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["Task", "Accuracy", "Centered", "Note"])
    for label, acc in out["results"].items():
        w.writerow([label, f"{acc:.6f}", f"{out['centered_results'][label]:.6f}", ""])
    for label in out["missing"]:
        w.writerow([label, "", "", "missing data file"])
    note = f"partial: {out['num_tasks']}/{out['num_tasks_total']} tasks" if out["partial"] else ""
    w.writerow(["CORE", "", f"{out['core_metric']:.6f}", note])
    atomic_write(path, lambda f: f.write(buf.getvalue().encode("utf-8")))


FLAGS = Flags(
    Flag("model_tag", None, "base checkpoint tag, e.g. d20; auto = the largest model", type=str, short="g"),
    Flag("step", None, "checkpoint step; auto = the last", type=int, short="s"),
    Flag("max_per_task", -1, "examples per task, -1 = all (fewer for quick checks)"),
    Flag("bundle_dir", None, "a local eval bundle dir (core.yaml, eval_data/...); auto = $NANOCHAT_DATA_DIR/core_eval, "
         "else <base_dir>/eval_bundle, else nanochat's eval_bundle.zip is downloaded there", type=str),
    device_type_flag(),
    Flag("dtype", "bfloat16", "autocast dtype on CUDA (CPU always runs float32)", choices=["bfloat16", "float32"]),
    description=__doc__,
)


def main(argv=None):
    args = FLAGS.parse_args(argv)

    from nanochat.checkpoint_manager import load_model

    device_type = args.device_type or autodetect_device_type()
    ddp, rank, local_rank, world_size, device = compute_init(device_type)
    try:
        bundle_dir = get_bundle_dir(args.bundle_dir)
    except FileNotFoundError as e:
        if args.bundle_dir is not None:
            raise  # the user named a directory: a wrong path is an error, not a skip
        # no data at all: say so (here and in the report) and let a pipeline go on with the stages that can run
        print0(f"Skipping CORE evaluation: {e}")
        if rank == 0:
            from nanochat.report import get_report

            get_report().log(section="Base model evaluation",
                             data=[{"CORE metric": "skipped (no eval bundle)", "Missing data": str(e).splitlines()[1:]}])
        compute_cleanup()
        return None
    model, tokenizer, meta = load_model("base", device, phase="eval", model_tag=args.model_tag, step=args.step)
    model_name = f"base_model_{meta['step']:06d}" if "step" in meta else "base_model"
    autocast = (torch.amp.autocast(device_type="cuda", dtype=torch.bfloat16)
                if device_type == "cuda" and args.dtype == "bfloat16" else contextlib.nullcontext())
    with autocast:
        out = evaluate_model(model, tokenizer, device, max_per_task=args.max_per_task, bundle_dir=bundle_dir)

    if rank == 0:
        print0("=" * 70)
        print0(f"{'Task':<36}{'Accuracy':>10}{'Centered':>12}")
        for label, acc in out["results"].items():
            print0(f"{label:<36}{acc:>10.4f}{out['centered_results'][label]:>12.4f}")
        for label in out["missing"]:
            print0(f"{label:<36}{'missing':>10}{'-':>12}")
        core = f"{out['core_metric']:.4f}"
        if out["partial"]:
            core += f" (partial: {out['num_tasks']}/{out['num_tasks_total']} tasks)"
            print0(f"CORE metric: {core}; missing: {', '.join(out['missing'])}")
        else:
            print0(f"CORE metric: {core}")

        out_dir = os.path.join(get_base_dir(), "base_eval")
        os.makedirs(out_dir, exist_ok=True)
        csv_path = os.path.join(out_dir, f"{model_name}.csv")
        write_results_csv(csv_path, out)
        print0(f"Results written to {csv_path}")

        from nanochat.report import get_report

        summary = {"Model": model_name, "CORE metric": core, "max_per_task": args.max_per_task,
                   "Eval bundle": out["bundle_dir"]}
        if out["partial"]:
            summary["Missing tasks"] = list(out["missing"])
        get_report().log(section="Base model evaluation", data=[summary, out["centered_results"]])
    compute_cleanup()
    return out


if __name__ == "__main__":
    main()
