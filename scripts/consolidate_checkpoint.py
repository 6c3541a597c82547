"""
Turn a sharded checkpoint (what the FSDP and TP paths write: <dir>/sharded_<step>/, nanochat/checkpoint/sharded.py) into
nanochat's single-file checkpoint: model_<step>.pt, meta_<step>.json and one optim_<step>_rank<r>.pt per rank of the
run that saved it, the same files, byte for byte, that --checkpoint_format=single writes. One process, no GPU.

    python -m scripts.consolidate_checkpoint -i base -g d40                # the last sharded step, next to it
    python -m scripts.consolidate_checkpoint -i base -g d40 -s 5000 --out /data/d40-single --optimizer=0

Nothing here needs it (training resumes from sharded steps, and evaluation, chat, export_hf and the next stage read
them directly); it is for tools that read nanochat's files, or to copy one file elsewhere.
"""

import os

from nanochat.checkpoint.files import sharded_step_dir
from nanochat.checkpoint.sharded import consolidate
from nanochat.checkpoint.steps import is_step_complete, sharded_steps
from nanochat.checkpoint_manager import checkpoint_flags, checkpoint_root, find_largest_model
from nanochat.configurator import Flag, Flags

FLAGS = Flags(
    checkpoint_flags("base", weights=False),
    Flag("out", None, "directory for the files; auto = the checkpoint's own directory, beside sharded_<step>/",
         type=str, short="o"),
    Flag("optimizer", True, "write the per-rank optimizer files too (0: model and meta only, what post-training and "
         "export need)"),
    description=__doc__,
)


def main(argv=None):
    args = FLAGS.parse_args(argv)
    try:
        root = checkpoint_root(args.source)
        tag = args.model_tag or find_largest_model(root)
        checkpoint_dir = os.path.join(root, tag)
        steps = sharded_steps(checkpoint_dir)
        if not steps:
            raise FileNotFoundError(f"no complete sharded checkpoint in {checkpoint_dir} (no sharded_<step>/ "
                                    f"directory): it holds single-file steps already, or none")
        step = steps[-1] if args.step is None else args.step
        if step not in steps:
            raise FileNotFoundError(f"step {step} is not a complete sharded checkpoint in {checkpoint_dir}; "
                                    f"complete sharded steps: {', '.join(map(str, steps))}")
        out = args.out or checkpoint_dir
        if is_step_complete(out, step):
            raise FileExistsError(f"{out} already holds model_{step:06d}.pt and meta_{step:06d}.json: nothing to do "
                                  f"(remove them to write them again, or pass another --out)")
        written = consolidate(sharded_step_dir(checkpoint_dir, step), out, step, optimizer=args.optimizer)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        FLAGS.error(str(e))  # usage + the reason, exit status 2
    print(f"Consolidated {args.source} {tag} step {step} into {out}: {', '.join(os.path.basename(p) for p in written)}")


if __name__ == "__main__":
    main()
