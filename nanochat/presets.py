"""
The depth presets: one table for every launcher (pretrain.sh, speedrun.sh, run1000.sh through scripts/launch.py),
docs/multinode.md and the tests, and the resolution of a launch's batch settings with the arithmetic the training
scripts themselves use (nanochat.batching). Standard library only: the launchers ask it before anything is installed.

    python -m nanochat.presets --depth 20 --world_size 8 --format shell   KEY=VALUE lines for a shell script to eval
    python -m nanochat.presets --depth 32 --world_size 32                 the same, for people
    python -m nanochat.presets --format markdown                          the table in docs/multinode.md

Flags after `--` are base_train's (as pretrain.sh passes them on): --total_batch_size and --max_seq_len there
change the arithmetic. Errors exit with status 2 and a message naming the flag to change.
"""

import math
import os
import shlex
import sys
from dataclasses import dataclass, field

from nanochat.batching import batch_arithmetic, sft_batch_arithmetic
from nanochat.usage import BadValue, run_main


@dataclass(frozen=True)
class Preset:
    num_shards: int  # FineWeb-Edu shards to download: ~20 tokens per parameter (Chinchilla) with room to spare
    device_batch_size: int  # rows of max_seq_len tokens per GPU per micro-step (base_train and mid_train)
    use_fsdp: bool  # FSDP2 instead of DDP: the params + grads + optimizer state no longer fit one 80 GB GPU
    activation_checkpointing: str  # none | full | selective (base_train's --activation_checkpointing, nanochat/gpt.py)
    tp_size: int  # tensor-parallel degree (--tp_size): GPUs of a node that share each row; 1 = off


# Device batch sizes for an 80 GB H100 at max_seq_len 2048. Measured on one H100 (docs/benchmarks.md, "One H100"):
# d20 x 32 compiled peaks at 70.7 GiB (48.3% MFU; 16 rows: 36.5%). The other depths are estimates; an eager probe in
# one process holding the whole optimizer state (a lower bound for an 8-GPU run) fit d26 x 8, d32 x 4 and d40 x 2.
# On an out-of-memory error halve --device_batch_size: gradient accumulation keeps the total batch and the result.
# How they were chosen, with estimate_gb() below:
#   activations ~ (34 * n_embd * n_layer + 6 * vocab) bytes per token (bf16, flash attention, no dropout: the
#   per-layer term of Korthikanti et al. 2022 without dropout masks, plus the bf16 logits and fp32 loss input), and
#   16 bytes per parameter for fp32 weights, grads and optimizer state.
# That is an upper bound (torch.compile fuses the elementwise ops and keeps fewer intermediates). nanochat has
# *measured* d20 at 32 rows (its speedrun) and d32 at 8 rows (its run1000) on 80 GB H100s with the same shapes; this
# formula puts d20 x 32 at ~92 "estimated GB". So each DDP depth gets the largest power of two whose estimate is at
# most that of the measured d20 x 32 (tests/integration/test_launch.py checks the table against this rule):
#   d20: 32 (= nanochat's speedrun; pretrain.sh said 16 before), d22: 16, d26: 16 (was 8), d32: 8 (= nanochat's
#   run1000; pretrain.sh said 4 before).
# FSDP depths (d40 up) stay at 1 row until measured: their estimate with the state sharded over 8 GPUs would allow
# more, but the parameters FSDP gathers per block are not in the formula.
#
# Activation checkpointing (AC column): off at every depth. REASONED; d20 on one H100 agrees (full AC: peak 70.7 ->
# 16.5 GiB, MFU 48.3% -> 38.9%; selective every 2nd block: 42.1 GiB, 41.1%):
#   - every device batch above already fits by the same rule without AC, so AC would only buy a larger device batch.
#     At the DDP depths the micro-batch is already >= 8 x 2048 = 16k tokens per matmul, enough to keep an H100's
#     tensor cores busy, so doubling it saves little (fewer gradient-accumulation passes), while full AC recomputes
#     one forward per step (~+33% FLOPs, MFU as the scripts count it falls by ~25%). A net loss.
#   - the FSDP depths at 1 row: estimate_gb() puts d64, the largest, at 46 GB on 8 GPUs (19 GB of activations,
#     27 GB of sharded state), far under the budget; with full AC the activations would be 2.2 GB.
# AC is what to reach for when a launch does not fit: an FSDP depth on fewer GPUs (d64 on 4: ~73 estimated GB,
# on 2: ~126, which full AC brings to ~109, still too much: more GPUs), a longer --max_seq_len, or an out-of-memory
# error at a device batch of 1. resolve() notes when a launch's estimate exceeds the budget and what full AC gives.
#
# Tensor parallelism (TP column): 1 at every depth. REASONED, not measured. TP splits each block's matmuls over the
# GPUs of a node; it pays off only when data parallelism (DDP/FSDP) cannot go on alone:
#   - FSDP's per-block all-gather no longer fits: one block in bf16 is 24 * n_embd^2 bytes, 0.4 GB at d64. No.
#   - the activations of one micro-batch of 1 row no longer fit: 19 GB at d64 without AC, 2.2 GB with. No.
#   - the global batch is too small for the data-parallel width: 524288 tokens = 256 rows of 2048, so more than
#     256 data-parallel ranks (32 nodes of 8) cannot each take a row. That depends on the world size, not the
#     depth, so no preset turns TP on; resolve() refuses such a launch naming --tp_size and --total_batch_size.
# TP also divides the data-parallel width by tp_size in the batch arithmetic below (the TP ranks of a group read
# the same rows).
PRESETS = {
    #   shards  rows  FSDP   AC      TP
    20: Preset(240, 32, False, "none", 1),
    22: Preset(300, 16, False, "none", 1),
    26: Preset(500, 16, False, "none", 1),
    32: Preset(800, 8, False, "none", 1),
    40: Preset(1500, 1, True, "none", 1),
    44: Preset(2000, 1, True, "none", 1),
    48: Preset(2500, 1, True, "none", 1),
    56: Preset(3500, 1, True, "none", 1),
    64: Preset(5000, 1, True, "none", 1),
}
FSDP_FROM_DEPTH = 40  # the FSDP default for a depth without a preset too
AC_MODES = ("none", "full", "selective")  # nanochat.gpt.AC_MODES (not imported: this module runs before torch is installed)
FINEWEB_SHARDS = 1823  # FineWeb-Edu-100B, nanochat's pretraining set; larger requests are capped (NANOCHAT_MAX_SHARDS)
VOCAB_SIZE = 65536  # the speedrun tokenizer's
# scripts.base_train's and scripts.chat_sft's defaults (tests/integration/test_launch.py checks they still agree)
TOTAL_BATCH_SIZE = 524288
MAX_SEQ_LEN = 2048
SFT_DEVICE_BATCH_SIZE = 4
SFT_TARGET_EXAMPLES = 32


# -----------------------------------------------------------------------------
# model size and memory estimate


def model_shape(depth):
    """(n_embd, n_head, parameters) of nanochat's depth rule (nanochat.gpt.config_for_depth) at VOCAB_SIZE."""
    n_embd = 64 * depth
    n_head = max(1, math.ceil(n_embd / 128))
    params = 2 * VOCAB_SIZE * n_embd + depth * 12 * n_embd * n_embd  # wte + lm_head + (4 attn + 8 mlp) d^2 per layer
    return n_embd, n_head, params


def checkpointed_blocks(depth, activation_checkpointing="none", ac_every=2):
    """How many blocks GPT.set_activation_checkpointing checkpoints (blocks 0, k, 2k, ... for selective)."""
    step = {"none": None, "full": 1, "selective": ac_every}[activation_checkpointing]
    return 0 if step is None else -(-depth // step)


def estimate_gb(depth, rows, max_seq_len=MAX_SEQ_LEN, state_shards=1, activation_checkpointing="none", ac_every=2):
    """
    Upper-bound GPU memory (GB) of one training rank; see the comment above PRESETS. A checkpointed block keeps
    only its bf16 input (2 * n_embd bytes per token) instead of its ~34 * n_embd, and during the backward one
    block's activations are rebuilt at a time (one more block's worth, when any block is checkpointed).
    """
    n_embd, _, params = model_shape(depth)
    ckpt = checkpointed_blocks(depth, activation_checkpointing, ac_every)
    per_token = 34 * n_embd * (depth - ckpt) + 2 * n_embd * ckpt + (34 * n_embd if ckpt else 0) + 6 * VOCAB_SIZE
    return (rows * max_seq_len * per_token + 16 * params / state_shards) / 1e9


# nanochat's measured d20 x 32 rows on an 80 GB H100 (see above): the estimate that is known to fit
BUDGET_GB = estimate_gb(20, 32)


# -----------------------------------------------------------------------------
# resolving a launch


@dataclass
class Launch:
    depth: int
    num_shards: int
    device_batch_size: int
    use_fsdp: bool
    activation_checkpointing: str
    tp_size: int
    world_size: int
    grad_accum: int  # base_train's accumulation steps (1 when posttraining only)
    est_gb: float  # estimate_gb() of one rank of this launch (an upper bound; BUDGET_GB is known to fit 80 GB)
    sft_args: list  # flags for chat_sft beyond its defaults, so that its batch splits over the world
    notes: list = field(default_factory=list)


def resolve(depth, num_shards=None, device_batch_size=None, use_fsdp=None, world_size=1, total_batch_size=TOTAL_BATCH_SIZE,
            max_seq_len=MAX_SEQ_LEN, mode="pretrain", max_shards=FINEWEB_SHARDS, activation_checkpointing=None,
            tp_size=None, ac_every=2):
    """The settings of one launch; a usage error (BadValue) naming the flag to change when there are none that work."""
    if mode not in ("pretrain", "posttrain", "fullrun"):
        raise BadValue(f"mode must be pretrain, posttrain or fullrun, got {mode!r}")
    notes = []
    preset = PRESETS.get(depth)
    if preset is None and (num_shards is None or device_batch_size is None):
        raise BadValue(f"no preset for --depth={depth}. Presets: {' '.join(f'd{d}' for d in PRESETS)}\n"
                         f"  (or give both --num_shards=N and --device_batch_size=N to run another depth)")
    num_shards = preset.num_shards if num_shards is None else num_shards
    if num_shards < 2:
        raise BadValue(f"--num_shards expects a whole number >= 2 (the last shard is validation), got {num_shards}")
    if num_shards > max_shards:
        # the d44+ presets ask for more than FineWeb-Edu-100B has: download it all, the loader repeats data
        notes.append(f"{num_shards} shards asked for but the dataset has {max_shards} (NANOCHAT_MAX_SHARDS): "
                     f"downloading {max_shards}, training repeats data")
        num_shards = max_shards
    dbs_given = device_batch_size is not None
    dbs = device_batch_size if dbs_given else preset.device_batch_size
    if dbs < 1:
        raise BadValue(f"--device_batch_size expects a whole number >= 1, got {dbs}")
    if use_fsdp is None:
        use_fsdp = preset.use_fsdp if preset else depth >= FSDP_FROM_DEPTH
    if world_size < 1:
        raise BadValue(f"world size must be >= 1, got {world_size}")
    ac = activation_checkpointing or (preset.activation_checkpointing if preset else "none")
    if ac not in AC_MODES:
        raise BadValue(f"--activation_checkpointing must be one of {'|'.join(AC_MODES)}, got {ac!r}")
    if ac == "selective" and ac_every < 1:
        raise BadValue(f"--ac_every must be a whole number >= 1 for --activation_checkpointing=selective, got {ac_every}")
    tp = tp_size if tp_size is not None else (preset.tp_size if preset else 1)
    if tp < 1 or world_size % tp != 0:
        raise BadValue(f"--tp_size must be a whole number >= 1 that divides the world size {world_size}, got {tp}")
    # the tp ranks of one group read the same rows: the batch splits over the data-parallel ranks only
    dp_world = world_size // tp

    # The preset batch is what fits one GPU; on many GPUs one micro-step of it can exceed the whole total batch
    # (d20: 32 rows x 2048 tokens x 16 GPUs = 1M tokens > 524288). Then halve it, loudly, unless it was given.
    procs = f"{dp_world} data-parallel ranks" if tp > 1 else f"{world_size} processes"
    if not dbs_given and total_batch_size > 0:
        before = dbs
        while dbs > 1 and dbs * max_seq_len * dp_world > total_batch_size:
            dbs //= 2
        if dbs != before:
            notes.append(f"preset device_batch_size {before} x {max_seq_len} tokens x {procs} exceeds "
                         f"total_batch_size {total_batch_size}: using {dbs} (pass --device_batch_size={before} "
                         f"--total_batch_size={before * max_seq_len * dp_world} to keep {before})")
    grad_accum = 1
    if mode != "posttrain":  # base_train would refuse it after the download and tokenizer: say so now
        if 0 < total_batch_size < dbs * max_seq_len * dp_world:
            # one row per rank is already more than the total: fewer data-parallel ranks (TP) or a bigger total
            tp_hint = next((t for t in (2, 4, 8) if world_size % t == 0 and t > tp
                            and dbs * max_seq_len * world_size // t <= total_batch_size), None)
            raise BadValue(
                f"one micro-step of {dbs} x {max_seq_len} tokens on each of {procs} is {dbs * max_seq_len * dp_world} "
                f"tokens, more than --total_batch_size={total_batch_size}: use --total_batch_size="
                f"{dbs * max_seq_len * dp_world}" + (f" or --tp_size={tp_hint} (tensor parallelism: {tp_hint} GPUs "
                                                     f"of a node share each row)" if tp_hint else ""))
        grad_accum, _ = batch_arithmetic(total_batch_size, dbs, max_seq_len, dp_world)

    # the memory estimate of one rank: a note (it is an upper bound, not a refusal) when it exceeds what fits
    shards = dp_world if use_fsdp else 1
    est = estimate_gb(depth, dbs, max_seq_len, shards, ac, ac_every)
    if est > BUDGET_GB:
        with_ac = estimate_gb(depth, dbs, max_seq_len, shards, "full")
        fix = (f"--activation_checkpointing=full brings it to ~{with_ac:.0f}" if ac != "full" and with_ac <= BUDGET_GB
               else "use more GPUs" + ("" if use_fsdp else " with --use_fsdp=1") + (" or a smaller --device_batch_size" if dbs > 1 else ""))
        notes.append(f"estimated {est:.0f} GB per GPU exceeds the ~{BUDGET_GB:.0f} estimated GB known to fit an 80 GB "
                     f"GPU (d20 x 32 rows, nanochat's speedrun): an out-of-memory error is likely; {fix}")

    # chat_sft counts whole conversations: its 32 per step must be device_batch_size x world x accumulation. Lower its
    # device batch (its default 4, or ours when smaller) until 32 splits; past that, one conversation per process.
    sft_args = []
    if mode != "pretrain":
        sft_dbs, target = min(dbs, SFT_DEVICE_BATCH_SIZE), SFT_TARGET_EXAMPLES
        while sft_dbs > 1 and not _sft_fits(target, sft_dbs, dp_world):
            sft_dbs //= 2
        if sft_dbs != SFT_DEVICE_BATCH_SIZE:
            sft_args.append(f"--device_batch_size={sft_dbs}")
        if not _sft_fits(target, sft_dbs, dp_world):
            target = -(-target // dp_world) * dp_world
            sft_args.append(f"--target_examples_per_step={target}")
            notes.append(f"chat_sft's {SFT_TARGET_EXAMPLES} conversations per step do not split over {procs}: "
                         f"using {target}")
        sft_batch_arithmetic(target, sft_dbs, dp_world)  # holds by construction; chat_sft runs the same check
    return Launch(depth, num_shards, dbs, use_fsdp, ac, tp, world_size, grad_accum, round(est, 1), sft_args, notes)


def _sft_fits(target, device_batch_size, world_size):
    try:
        sft_batch_arithmetic(target, device_batch_size, world_size)
        return True
    except ValueError:
        return False


# -----------------------------------------------------------------------------
# output


def shell_lines(launch):
    """Assignments for bash's eval: scalars, and arrays for the chat_sft flags and the notes."""
    array = lambda xs: "(" + " ".join(shlex.quote(x) for x in xs) + ")"
    return [
        f"DEPTH={launch.depth}",
        f"NUM_SHARDS={launch.num_shards}",
        f"DEVICE_BATCH_SIZE={launch.device_batch_size}",
        f"USE_FSDP={int(launch.use_fsdp)}",
        f"ACTIVATION_CHECKPOINTING={launch.activation_checkpointing}",
        f"TP_SIZE={launch.tp_size}",
        f"LAUNCH_WORLD_SIZE={launch.world_size}",
        f"GRAD_ACCUM={launch.grad_accum}",
        f"EST_GB={launch.est_gb}",
        f"SFT_ARGS={array(launch.sft_args)}",
        f"NOTES={array(launch.notes)}",
    ]


def markdown_table(world_size=8):
    """The preset table of docs/multinode.md (estimates for FSDP depths shard the state over world_size GPUs)."""
    rows = ["| depth | n_embd / heads | params (vocab 65536) | 20 tokens/param | shards | device batch | FSDP | AC | TP "
            "| est. GB | est. GB, full AC |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for depth, p in PRESETS.items():
        n_embd, n_head, params = model_shape(depth)
        shards = f"{p.num_shards} ({FINEWEB_SHARDS} exist)" if p.num_shards > FINEWEB_SHARDS else str(p.num_shards)
        state_shards = world_size if p.use_fsdp else 1
        est = estimate_gb(depth, p.device_batch_size, state_shards=state_shards, activation_checkpointing=p.activation_checkpointing)
        est_full = estimate_gb(depth, p.device_batch_size, state_shards=state_shards, activation_checkpointing="full")
        rows.append(f"| d{depth} | {n_embd} / {n_head} | {params / 1e9:.2f} B | {20 * params / 1e9:.0f} B | {shards} "
                    f"| {p.device_batch_size} | {'yes' if p.use_fsdp else 'no'} | {p.activation_checkpointing} "
                    f"| {p.tp_size} | {est:.0f} | {est_full:.0f} |")
    return "\n".join(rows)


def _whole(name, text, minimum):
    """The whole number in `text`, from an environment variable or a training flag (`name` says which)."""
    try:
        value = int(text)
    except ValueError:
        raise BadValue(f"{name} expects a whole number, got {text!r}") from None
    if value < minimum:
        raise BadValue(f"{name} expects a whole number >= {minimum}, got {value}")
    return value


def _train_flag(train_args, name, default):
    """The value of --name=V among base_train's flags (pretrain.sh passes them on as --name=value)."""
    value = default
    for a in train_args:
        if a.startswith(f"--{name}="):
            value = _whole(f"--{name}", a.split("=", 1)[1], 0)
    return value


def resolve_launch(depth, train_args=(), max_shards=None, **settings):
    """resolve() for a launcher: --total_batch_size, --max_seq_len and --ac_every read from the training flags it
    passes on (as --name=value), the shard cap from NANOCHAT_MAX_SHARDS unless given."""
    if max_shards is None:
        max_shards = _whole("NANOCHAT_MAX_SHARDS", os.environ.get("NANOCHAT_MAX_SHARDS", str(FINEWEB_SHARDS)), 2)
    return resolve(depth, total_batch_size=_train_flag(train_args, "total_batch_size", TOTAL_BATCH_SIZE),
                   max_seq_len=_train_flag(train_args, "max_seq_len", MAX_SEQ_LEN), max_shards=max_shards,
                   ac_every=_train_flag(train_args, "ac_every", 2), **settings)


def _flags():
    from nanochat.configurator import Flag, Flags

    return Flags(
        Flag("depth", None, "model depth (a preset, or any depth with both --num_shards and --device_batch_size)",
             type=int, min=1),
        Flag("num_shards", None, "override the preset's shards of pretraining data", type=int, min=0),
        Flag("device_batch_size", None, "override the preset's rows per GPU (then it is never halved)", type=int,
             min=0),
        Flag("use_fsdp", None, "override the FSDP default (on from d40)", type=bool),
        Flag("activation_checkpointing", None, "override the preset's activation checkpointing", type=str,
             choices=list(AC_MODES)),
        Flag("tp_size", None, "override the preset's tensor-parallel degree", type=int, min=1),
        Flag("world_size", 1, "processes over all nodes", min=1),
        Flag("mode", "pretrain", "which stages the launch runs", choices=["pretrain", "posttrain", "fullrun"]),
        Flag("max_shards", None, f"shards the dataset has (auto: $NANOCHAT_MAX_SHARDS or {FINEWEB_SHARDS})", type=int,
             min=2),
        Flag("format", "text", "text: key=value lines; shell: lines for a shell script to eval; markdown: the preset table",
             choices=["text", "shell", "markdown"]),
        prog="python -m nanochat.presets", description=__doc__,
    )


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    train_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    flags = _flags()
    args = flags.parse_args(argv)
    if args.format == "markdown":
        print(markdown_table())
        return 0
    if args.depth is None:
        flags.error("--depth is required (except with --format markdown)")
    launch = resolve_launch(args.depth, train_args, args.max_shards, num_shards=args.num_shards,
                            device_batch_size=args.device_batch_size, use_fsdp=args.use_fsdp,
                            world_size=args.world_size, mode=args.mode,
                            activation_checkpointing=args.activation_checkpointing, tp_size=args.tp_size)
    if args.format == "shell":
        print("\n".join(shell_lines(launch)))
    else:
        for k, v in vars(launch).items():
            print(f"{k}={v}")
    return 0


if __name__ == "__main__":
    run_main(main)
