"""
Saving and loading checkpoints, in nanochat's layout so its checkpoints load here and ours load there:

    <base_dir>/<phase dir>/<model_tag>/model_{step:06d}.pt          model state dict (rank 0 writes)
                                       meta_{step:06d}.json         model_config, user_config, loop/loader state, val bpb
                                       optim_{step:06d}_rank{r}.pt  optimizer state, one file per rank (every rank writes)
                                       sharded_{step:06d}/          or one sharded step (every rank writes its shard:
                                                                    nanochat/checkpoint/sharded.py)

This module is nanochat's front door (save_checkpoint, load_checkpoint, build_model, load_model, find_largest_model,
find_last_step, with nanochat's signatures); the checkpoint package below it owns the rest:

    nanochat/checkpoint/files.py        file names, atomic writes, stale temp files, the free-space check
    nanochat/checkpoint/steps.py        step_format: which steps are complete, in which format (the one place)
    nanochat/checkpoint/sharded.py      the sharded format (torch.distributed.checkpoint), resharding, consolidation
    nanochat/checkpoint/train_state.py  a training run's state (model, optimizers, data position) saved and restored
    nanochat/checkpoint/resume.py       --resume_from_step: which step, restored into the run

Writes are atomic (temp file, fsync, rename) and meta is written last, after every rank has written its optimizer
file, so a step "exists" only when it is complete. A crash mid-save leaves the previous step loadable; loading skips
incomplete steps with a warning. A complete step whose files were damaged later (a truncated copy) is not skipped:
loading it names the file and the previous complete step to fall back to.

Automatic resume (`--resume_from_step=auto`, `latest_resumable_step`) is stricter: it takes the latest step that
`step_problem` finds nothing wrong with (all files present, meta readable, torch files not cut short, one optimizer
file per rank that wrote it) and names every later step it skips and why, so a job restarted after a crash in the
middle of a save, or on a damaged disk, goes on from the previous good step by itself.
"""

import logging
import os
import re

import torch

from nanochat.checkpoint.files import atomic_json_save, atomic_torch_save, step_paths
from nanochat.checkpoint.steps import (
    SHARDED, complete_steps, model_steps, move_aside_hint, read_meta, read_step_meta, require_step, step_format,
    step_meta_path, torch_load_file
)
from nanochat.common import get_base_dir, setup_default_logging
from nanochat.distributed.dist import barrier
from nanochat.usage import BadValue, Missing

setup_default_logging()
logger = logging.getLogger(__name__)

# where each training stage keeps its checkpoints (nanochat's names)
PHASE_DIRS = {
    "base": "base_checkpoints",
    "mid": "mid_checkpoints",
    "sft": "chatsft_checkpoints",
    "rl": "chatrl_checkpoints",
}


def checkpoint_root(source):
    if source not in PHASE_DIRS:
        raise BadValue(f"unknown checkpoint source {source!r}: use one of {', '.join(PHASE_DIRS)}")
    return os.path.join(get_base_dir(), PHASE_DIRS[source])


def checkpoint_flags(source="sft", required=False, weights=True):
    """-i/--source, -g/--model_tag, -s/--step: which checkpoint a CLI loads (chat_cli, chat_web, chat_eval, export_hf),
    and --weights_dtype, the dtype it loads the weights in (weights=False: a tool that loads no model)."""
    from nanochat.configurator import Flag

    return [
        Flag("source", None if required else source, "which stage's checkpoints to load", type=str,
             choices=list(PHASE_DIRS), short="i", required=required),
        Flag("model_tag", None, "model tag, e.g. d20; auto = the largest model", type=str, short="g"),
        Flag("step", None, "checkpoint step; auto = the last", type=int, short="s"),
    ] + ([weights_dtype_flag()] if weights else [])


def weights_dtype_flag():
    """--weights_dtype of the scripts that load a model to evaluate or serve it (weights_dtype_for); its default is
    $NANOCHAT_WEIGHTS_DTYPE when set."""
    from nanochat.configurator import Flag

    return Flag("weights_dtype", "auto", "dtype the loaded weights are held in: auto = bfloat16 for evaluation on CUDA "
                "(autocast rounds to it anyway, at half the memory), float32 elsewhere", choices=list(WEIGHTS_DTYPES),
                env="NANOCHAT_WEIGHTS_DTYPE")


# -----------------------------------------------------------------------------
# save / load one step (the single-file format; a sharded step loads through here too)


def save_checkpoint(checkpoint_dir, step, model_data, optimizer_data, meta_data, rank=0):
    """
    Every rank calls this. Rank 0 writes the model; every rank writes its own optimizer shard (the optimizer state is
    sharded across ranks); after a barrier rank 0 writes meta, which marks the step complete.
    model_data may be None on ranks other than 0; optimizer_data may be None to skip optimizer state.
    """
    # every node creates the directory: on multi-node without a shared filesystem each node writes its own shards
    os.makedirs(checkpoint_dir, exist_ok=True)
    model_path, meta_path, optim_path = step_paths(checkpoint_dir, step, rank)
    if rank == 0:
        if model_data is None:
            raise ValueError("rank 0 must pass the model state dict to save_checkpoint")
        atomic_torch_save(model_data, model_path)
    if optimizer_data is not None:
        atomic_torch_save(optimizer_data, optim_path)
    barrier()  # all optimizer shards are on disk before the step is declared complete
    if rank == 0:
        atomic_json_save(meta_data, meta_path)
        logger.info(f"Saved checkpoint step {step} to {checkpoint_dir}")
    barrier()


def load_checkpoint(checkpoint_dir, step, device, load_optimizer=False, rank=0):
    """
    Returns (model_state_dict, optimizer_state_dict or None, meta_dict).
    The model state dict stays on the CPU, memory-mapped from the file (mmap=True): no bytes are read until a tensor
    is used, so moving it tensor by tensor to the GPU holds one copy there and none in process memory, and an FSDP
    rank that slices its rows out of each tensor reads only those rows. The optimizer state (per rank, small) goes
    to `device`. A file that is truncated or not what it should be raises a ValueError naming it and the way out.
    """
    if step_format(checkpoint_dir, step) == SHARDED:
        return _load_sharded_model(checkpoint_dir, step, load_optimizer)
    require_step(checkpoint_dir, step)
    model_path, meta_path, optim_path = step_paths(checkpoint_dir, step, rank)
    meta_data = read_meta(meta_path, checkpoint_dir, step)
    model_data = torch_load_file(model_path, "model", checkpoint_dir, step, map_location="cpu", mmap=True,
                                 weights_only=True)
    if not isinstance(model_data, dict):
        raise BadValue(f"checkpoint model {model_path} holds a {type(model_data).__name__}, not a state dict: "
                       f"{move_aside_hint(checkpoint_dir, step)}")
    optimizer_data = None
    if load_optimizer:
        if not os.path.exists(optim_path):
            raise Missing(
                f"{optim_path} does not exist: optimizer state is saved per rank, so resume with the same number of "
                f"ranks as the run that wrote step {step} (or pass the model only)"
            )
        optimizer_data = torch_load_file(optim_path, "optimizer state", checkpoint_dir, step, map_location=device,
                                         weights_only=False)
    return model_data, optimizer_data, meta_data


def _load_sharded_model(checkpoint_dir, step, load_optimizer):
    """load_checkpoint for a sharded step (nanochat/checkpoint/sharded.py): the full model assembled in this process."""
    from nanochat.checkpoint.files import sharded_step_dir
    from nanochat.checkpoint.sharded import read_model_state_dict

    if load_optimizer:
        raise BadValue(f"step {step} in {checkpoint_dir} is a sharded checkpoint: its optimizer state resumes on the "
                       f"FSDP or tensor-parallel path (--use_fsdp=1 or --tp_size, any number of ranks), or consolidate "
                       f"it into per-rank files first (python -m scripts.consolidate_checkpoint)")
    return read_model_state_dict(sharded_step_dir(checkpoint_dir, step)), None, read_step_meta(checkpoint_dir, step)


def resolve_checkpoint(source, model_tag=None, step=None):
    """
    (model_tag, step) of the checkpoint a script is about to load, checked at start-up: the stage has checkpoints,
    the tag and step exist, and the tokenizer in the base dir is there and has the model's vocabulary. Each problem
    is a usage error (nanochat/usage.py) naming what there is.
    """
    from nanochat.tokenizer import get_tokenizer

    root = checkpoint_root(source)
    if not os.path.isdir(root):
        raise Missing(f"no {source} checkpoints: {root} does not exist; train that stage first")
    tag = model_tag or find_largest_model(root)
    checkpoint_dir = os.path.join(root, tag)
    if not os.path.isdir(checkpoint_dir):
        tags = sorted(t for t in os.listdir(root) if os.path.isdir(os.path.join(root, t))) if os.path.isdir(root) else []
        raise Missing(f"no checkpoints for model tag {tag!r} in {root}"
                      + (f": the tags there are {', '.join(tags)}" if tags else ": train that stage first"))
    step = find_last_step(checkpoint_dir) if step is None else step
    require_step(checkpoint_dir, step)
    vocab = (read_step_meta(checkpoint_dir, step).get("model_config") or {}).get("vocab_size")
    tokenizer_vocab = get_tokenizer().get_vocab_size()
    if vocab is not None and tokenizer_vocab != vocab:
        raise BadValue(f"tokenizer vocab {tokenizer_vocab} != model vocab {vocab}: the tokenizer in "
                       f"{get_base_dir()}/tokenizer is not the one {checkpoint_dir} step {step} was trained with")
    return tag, step


def find_largest_model(checkpoints_dir):
    """The model tag to use by default: the largest d<N> tag, else the most recently modified directory."""
    if not os.path.isdir(checkpoints_dir):
        raise Missing(f"no checkpoints directory at {checkpoints_dir}: train that stage first")
    tags = [t for t in os.listdir(checkpoints_dir) if os.path.isdir(os.path.join(checkpoints_dir, t))]
    if not tags:
        raise Missing(f"no model tags in {checkpoints_dir}: train that stage first")
    depth_tags = []
    for t in tags:
        m = re.fullmatch(r"d(\d+)", t)
        if m:
            depth_tags.append((int(m.group(1)), t))
    if depth_tags:
        return max(depth_tags)[1]
    return max(tags, key=lambda t: os.path.getmtime(os.path.join(checkpoints_dir, t)))


def find_last_step(checkpoint_dir):
    """Last complete step (either format). Incomplete steps are skipped with a warning."""
    complete = complete_steps(checkpoint_dir)
    for s in sorted(model_steps(checkpoint_dir) - set(complete)):
        logger.warning(f"skipping incomplete checkpoint step {s} in {checkpoint_dir} (no meta_{s:06d}.json)")
    if not complete:
        raise Missing(f"no complete checkpoint in {checkpoint_dir}")
    return complete[-1]


# -----------------------------------------------------------------------------
# building models


def clean_state_dict(state_dict):
    """Strip torch.compile's `_orig_mod.` prefix (nanochat checkpoints saved from a compiled model carry it)."""
    return {k.removeprefix("_orig_mod."): v for k, v in state_dict.items()}


WEIGHTS_DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


def weights_dtype_for(device_type, phase, requested=None):
    """
    The dtype the weights of a loaded model are held in. requested: auto|bfloat16|float32 (the scripts' --weights_dtype,
    whose default is $NANOCHAT_WEIGHTS_DTYPE), default auto. auto = bf16 for evaluation/inference on CUDA, fp32
    otherwise:
    - CUDA eval: the matmuls run under bf16 autocast, which rounds fp32 weights to bf16 on every forward anyway, so
      bf16 weights give the same matmuls at half the memory (an fp32 d64 plus its autocast copies does not leave
      room to evaluate on one 80 GB GPU) and without the per-forward casts.
    - training keeps fp32 master weights (the optimizers need them); CPU/MPS compute in fp32 (bf16 matmuls on CPU are
      ~10x slower), so bf16 checkpoints written on a GPU are widened there.
    """
    requested = requested or "auto"
    if requested not in WEIGHTS_DTYPES:
        raise BadValue(f"--weights_dtype must be one of {'|'.join(WEIGHTS_DTYPES)}, got {requested!r}")
    if WEIGHTS_DTYPES[requested] is not None:
        return WEIGHTS_DTYPES[requested]
    return torch.bfloat16 if device_type == "cuda" and phase == "eval" else torch.float32


def model_from_state_dict(model_data, config, device, dtype=torch.float32):
    """
    The model `config` describes (GPT, or RecordGPT for a record-recipe config: nanochat/gpt.py make_model) holding
    `model_data` on `device`, built without a second copy of the weights: the modules are made on the meta device (no
    memory), each checkpoint tensor is moved/cast once and assigned into place, and only the derived buffers (rotary
    tables) are computed on the device. (to_empty() + init_weights() before loading would hold two full copies on the
    device at once.) Floating tensors are cast to `dtype`.
    """
    from nanochat.gpt import make_model

    device = torch.device(device)
    state = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in model_data.items()}
    with torch.device("meta"):
        model = make_model(config)
    model.load_state_dict(state, strict=True, assign=True)
    model.init_buffers()  # rotary tables on the device, attention backend for it
    return model


SHAPE_FIELDS = ("vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd")  # the GPTConfig fields that shape weights


def model_config_from_meta(meta, meta_path):
    """The model config a meta's model_config describes (GPTConfig, or RecordConfig when it has the record model's
    window_pattern: nanochat/gpt.py config_from_dict); a missing or foreign one names the file."""
    from nanochat.gpt import config_from_dict

    cfg = meta.get("model_config")
    if not isinstance(cfg, dict):
        raise BadValue(
            f"checkpoint meta {meta_path} has no model_config object (its keys: {sorted(meta)}), so the model cannot "
            f"be rebuilt: it was not written by nanochat's save_checkpoint; copy the meta of that step again"
        )
    try:
        return config_from_dict(cfg)
    except TypeError as e:
        raise BadValue(f"the model_config in {meta_path} is not a GPTConfig ({e}): {cfg}") from e


def checkpoint_model_config(source, model_tag, step):
    """The GPTConfig a saved step was built with, from its meta alone (no tensor is read), checked: what the start-up
    checks of a model's shape (sequence length, tensor parallelism) read before the model loads."""
    from nanochat.gpt import check_config

    checkpoint_dir = os.path.join(checkpoint_root(source), model_tag)
    meta_path = step_meta_path(checkpoint_dir, step)
    config = model_config_from_meta(read_meta(meta_path, checkpoint_dir, step), meta_path)
    check_config(config)
    return config


def _describe_weights(state_dict):
    """The config fields that can be read off the weights' names and shapes."""
    layers = {int(m.group(1)) for k in state_dict if (m := re.match(r"transformer\.h\.(\d+)\.", k))}
    out = {"n_layer": len(layers)}
    wte = state_dict.get("transformer.wte.weight")
    if wte is not None and wte.dim() == 2:
        out["vocab_size"], out["n_embd"] = int(wte.shape[0]), int(wte.shape[1])
    return out


def check_weights_match_config(state_dict, config, model_path, meta_path):
    """Refuse weights that are not the model the meta's model_config describes, naming both files and both shapes."""
    from nanochat.gpt import make_model

    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in make_model(config).state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state_dict.items()}
    if expected == got:
        return
    missing, unexpected = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
    shapes = [k for k in expected if k in got and expected[k] != got[k]]
    detail = []
    recipes = ["record" if "resid_lambdas" in keys else "december" for keys in (got, expected)]  # RecordGPT's own
    if recipes[0] != recipes[1]:
        detail.append(f"the weights are a {recipes[0]}-recipe model, the model_config a {recipes[1]}-recipe one")
    if missing:
        detail.append(f"{len(missing)} tensor(s) missing from the weights, e.g. {missing[0]}")
    if unexpected:
        detail.append(f"{len(unexpected)} unexpected tensor(s) in the weights, e.g. {unexpected[0]}")
    if shapes:
        detail.append(f"{len(shapes)} of other shape, e.g. {shapes[0]} is {list(got[shapes[0]])} in the weights, "
                      f"{list(expected[shapes[0]])} for the config")
    meta_cfg = ", ".join(f"{f}={getattr(config, f)}" for f in SHAPE_FIELDS)
    weights_cfg = ", ".join(f"{f}={v}" for f, v in _describe_weights(state_dict).items())
    raise BadValue(
        f"the model_config in {meta_path} ({meta_cfg}) does not match the weights in {model_path} ({weights_cfg}): "
        f"{'; '.join(detail)}. The two files come from different models: copy both from the same run and step"
    )


def build_model(checkpoint_dir, step, device, phase, weights_dtype=None):
    """Rebuild a GPT from a checkpoint. phase: 'train' or 'eval' (sets model.train()/eval()); weights_dtype: see
    weights_dtype_for."""
    from nanochat.tokenizer import get_tokenizer

    if phase not in ("train", "eval"):
        raise BadValue(f"phase must be 'train' or 'eval', got {phase!r}")
    device = torch.device(device)
    dtype = weights_dtype_for(device.type, phase, weights_dtype)
    model_data, _, meta = load_checkpoint(checkpoint_dir, step, device, load_optimizer=False)
    model_path, meta_file = step_paths(checkpoint_dir, step)[0], step_meta_path(checkpoint_dir, step)
    config = model_config_from_meta(meta, meta_file)
    model_data = clean_state_dict(model_data)
    check_weights_match_config(model_data, config, model_path, meta_file)
    model = model_from_state_dict(model_data, config, device, dtype)
    del model_data
    model.train() if phase == "train" else model.eval()
    tokenizer = get_tokenizer()
    if tokenizer.get_vocab_size() != config.vocab_size:
        raise BadValue(
            f"tokenizer vocab {tokenizer.get_vocab_size()} != model vocab {config.vocab_size}: the tokenizer in "
            f"{get_base_dir()}/tokenizer is not the one this model was trained with"
        )
    return model, tokenizer, meta


def load_model_from_dir(checkpoints_dir, device, phase, model_tag=None, step=None, weights_dtype=None):
    if model_tag is None:
        model_tag = find_largest_model(checkpoints_dir)
        logger.info(f"No model tag given, using {model_tag}")
    checkpoint_dir = os.path.join(checkpoints_dir, model_tag)
    if not os.path.isdir(checkpoint_dir):
        raise Missing(f"no checkpoints for model tag {model_tag!r} in {checkpoints_dir}")
    if step is None:
        step = find_last_step(checkpoint_dir)
    return build_model(checkpoint_dir, step, device, phase, weights_dtype)


def load_model(source, device, phase, model_tag=None, step=None, weights_dtype=None):
    """(model, tokenizer, meta) for source in base|mid|sft|rl: the largest model tag and last step by default."""
    return load_model_from_dir(checkpoint_root(source), device, phase, model_tag=model_tag, step=step, weights_dtype=weights_dtype)
