"""
Evaluate a chat model on ARC-Easy, ARC-Challenge, MMLU, GSM8K, HumanEval and SpellingBee, and their summary ChatCORE.

    python -m scripts.chat_eval -i sft                          # every task
    python -m scripts.chat_eval -i mid -a "ARC-Easy|GSM8K" -x 100
    torchrun --nproc_per_node=8 -m scripts.chat_eval -i sft     # problems split over 8 GPUs

How each task is scored and what ChatCORE is: nanochat/chat_eval.py. Which split of which data each task reads:
tasks/suites.py. A task whose data cannot be found is skipped with a message naming what is missing, and ChatCORE is then marked partial. Under torchrun a task is evaluated only if
every rank found its data (the ranks agree before evaluating it, so their counts are always summed for one task).
"""

import contextlib
import os

import torch

from nanochat.chat_eval import TASK_NAMES, chatcore, evaluate_task
from nanochat.common import autodetect_device_type, compute_cleanup, compute_init, device_type_flag, print0
from nanochat.attention import attn_flag
from nanochat.checkpoint_manager import checkpoint_flags, resolve_checkpoint
from nanochat.distributed.dist import process_data_ranks
from nanochat.configurator import Flag, Flags
from nanochat.data.task_data import TaskDataNotFound
from nanochat.usage import BadValue, CannotRun, Missing, run_main
from nanochat.engine import decode_compile_flag
from tasks.suites import build_eval_task_on_every_rank


FLAGS = Flags(
    "model",
    checkpoint_flags(required=True),
    Flag("dtype", "bfloat16", "autocast dtype on CUDA (CPU always runs float32)", choices=["float32", "bfloat16"],
         short="d"),
    device_type_flag(),
    attn_flag(),
    decode_compile_flag(),
    "tasks",
    Flag("task_name", "all", "a task, several joined by '|', or all: " + ", ".join(TASK_NAMES), short="a"),
    Flag("max_problems", None, "evaluate at most this many problems per task; auto = all", type=int, short="x", min=1),
    Flag("data_dir", None, "local task data dir; auto = $NANOCHAT_DATA_DIR", type=str),
    Flag("unsafe_sandbox", False, "run HumanEval's generated code even where the sandbox lacks its process, "
         "filesystem or network layer (see docs/sandbox.md)"),
    "generation",
    Flag("temperature", 0.0, "sampling temperature of generative tasks (0 = greedy)", short="t", min=0.0),
    Flag("max_new_tokens", 512, "most tokens per generated answer", short="m", min=1),
    Flag("num_samples", 1, "samples per generative problem (pass@n)", short="n", min=1),
    Flag("top_k", 50, "sample among the k most likely tokens (0 = all)", short="k", min=0),
    Flag("batch_size", 8, "problems per forward in categorical tasks; sequences decoded together in generative ones "
         "(continuous batching; 1 = one problem at a time through the Engine)", short="b", min=1),
    description=__doc__,
)


def parse_task_names(spec):
    if spec is None or spec == "all":
        return list(TASK_NAMES)
    names = [s.strip() for s in spec.split("|") if s.strip()]
    unknown = [s for s in names if s not in TASK_NAMES]
    if unknown:
        raise BadValue(f"-a/--task_name: unknown task(s) {', '.join(unknown)}; choose from {'|'.join(TASK_NAMES)} or all")
    return names


def main(argv=None):
    args = FLAGS.parse_args(argv)
    task_names = parse_task_names(args.task_name)
    if "HumanEval" in task_names:  # before loading anything: can generated code be run safely here?
        from nanochat.execution import SandboxUnavailable, require_isolation

        try:
            require_isolation(args.unsafe_sandbox)
        except SandboxUnavailable as e:
            raise CannotRun(str(e)) from None
    if args.data_dir is not None and not os.path.isdir(args.data_dir):
        raise Missing(f"--data_dir {args.data_dir} is not a directory: point it at the local task data (the layout "
                      f"of docs/data.md), or leave it out to use $NANOCHAT_DATA_DIR and the Hugging Face cache")
    model_tag, step = resolve_checkpoint(args.source, args.model_tag, args.step)  # start-up check: it exists

    from nanochat.checkpoint_manager import load_model
    from nanochat.engine import Engine

    device_type = args.device_type or autodetect_device_type()
    ddp, rank, local_rank, world_size, device = compute_init(device_type)
    autocast = (torch.amp.autocast(device_type="cuda", dtype=torch.bfloat16)
                if device_type == "cuda" and args.dtype == "bfloat16" else contextlib.nullcontext())

    # the tasks' data before the model: a task without data is skipped, and a run left with no task at all stops here
    tasks, missing = {}, {}
    for name in task_names:
        try:
            tasks[name] = build_eval_task_on_every_rank(name, args.data_dir, args.unsafe_sandbox)
        except TaskDataNotFound as e:
            missing[name] = "; ".join(e.looked)
            print0(f"Skipping {name}: {e}")
    if not tasks:
        compute_cleanup()
        raise Missing(f"no data for any task asked for ({', '.join(task_names)}): looked in "
                      + "; ".join(f"{name}: {where}" for name, where in missing.items()))

    model, tokenizer, meta = load_model(args.source, device, phase="eval", model_tag=model_tag, step=step,
                                        weights_dtype=args.weights_dtype)
    print0(f"attention: {model.set_attn(args.attn).describe()}")
    engine = Engine(model, tokenizer, args.decode_compile)

    results = {}
    for name, task in tasks.items():
        with autocast:
            acc = evaluate_task(task, model, tokenizer, engine, batch_size=args.batch_size,
                                num_samples=args.num_samples, max_new_tokens=args.max_new_tokens,
                                temperature=args.temperature, top_k=args.top_k, max_problems=args.max_problems,
                                ranks=process_data_ranks())  # no tensor parallelism here: the process group's
        results[name] = acc
        print0(f"{name} accuracy: {100 * acc:.2f}%")

    summary = {}
    if set(task_names) == set(TASK_NAMES):
        # ChatCORE is defined over all six tasks; a run that asked for fewer gets no ChatCORE at all
        score, _ = chatcore(results)
        if missing:
            summary["ChatCORE metric"] = f"{score:.4f} (partial: {len(results)}/{len(TASK_NAMES)} tasks)"
            summary["Missing tasks"] = [f"{name}: {reason}" for name, reason in missing.items()]
            print0(f"ChatCORE metric: {summary['ChatCORE metric']}; missing: {', '.join(missing)}")
        else:
            summary["ChatCORE metric"] = score
            print0(f"ChatCORE metric: {score:.4f}")
    elif missing:
        summary["Missing tasks"] = [f"{name}: {reason}" for name, reason in missing.items()]

    if rank == 0:
        from nanochat.report import get_report

        get_report().log(section=f"Chat evaluation {args.source}", data=[dict(args), results, summary])
    compute_cleanup()
    return {"results": results, "missing": missing, **summary}


if __name__ == "__main__":
    run_main(main)  # a usage error: one line, exit 2 (nanochat/usage.py); a bug keeps its traceback
