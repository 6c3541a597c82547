"""
Saving and loading checkpoints, in nanochat's layout so its checkpoints load here and ours load there:

    <base_dir>/<phase dir>/<model_tag>/model_{step:06d}.pt          model state dict (rank 0 writes)
                                       meta_{step:06d}.json         model_config, user_config, loop/loader state, val bpb
                                       optim_{step:06d}_rank{r}.pt  optimizer state, one file per rank (every rank writes)
                                       sharded_{step:06d}/          or, from the FSDP path, one sharded step (every
                                                                    rank writes its shard: nanochat/sharded_checkpoint.py)

Writes are atomic (temp file, fsync, rename) and meta is written last, after every rank has written its optimizer
file, so a step "exists" only when it is complete. A crash mid-save leaves the previous step loadable; loading skips
incomplete steps with a warning. A complete step whose files were damaged later (a truncated copy) is not skipped:
loading it names the file and the previous complete step to fall back to.

Automatic resume (`--resume_from_step=auto`, `latest_resumable_step`) is stricter: it takes the latest step that
`step_problem` finds nothing wrong with (all files present, meta readable, torch files not cut short, one optimizer
file per rank that wrote it) and names every later step it skips and why, so a job restarted after a crash in the
middle of a save, or on a damaged disk, goes on from the previous good step by itself.
"""

import glob
import json
import logging
import os
import re

import torch

from nanochat.atomic import atomic_write, short_error, torch_file_problem
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


# -----------------------------------------------------------------------------
# atomic writes


def checkpoint_flags(source="sft", required=False):
    """-i/--source, -g/--model_tag, -s/--step: which checkpoint a CLI loads (chat_cli, chat_web, chat_eval, export_hf)."""
    from nanochat.configurator import Flag

    return [
        Flag("source", None if required else source, "which stage's checkpoints to load", type=str,
             choices=list(PHASE_DIRS), short="i", required=required),
        Flag("model_tag", None, "model tag, e.g. d20; auto = the largest model", type=str, short="g"),
        Flag("step", None, "checkpoint step; auto = the last", type=int, short="s"),
    ]


def atomic_torch_save(obj, path):
    atomic_write(path, lambda f: torch.save(obj, f))


def atomic_json_save(obj, path):
    data = json.dumps(obj, indent=2).encode("utf-8")
    atomic_write(path, lambda f: f.write(data))


# -----------------------------------------------------------------------------
# save / load one step


def _paths(checkpoint_dir, step, rank=0):
    return (
        os.path.join(checkpoint_dir, f"model_{step:06d}.pt"),
        os.path.join(checkpoint_dir, f"meta_{step:06d}.json"),
        os.path.join(checkpoint_dir, f"optim_{step:06d}_rank{rank:d}.pt"),
    )


def save_checkpoint(checkpoint_dir, step, model_data, optimizer_data, meta_data, rank=0):
    """
    Every rank calls this. Rank 0 writes the model; every rank writes its own optimizer shard (the optimizer state is
    sharded across ranks); after a barrier rank 0 writes meta, which marks the step complete.
    model_data may be None on ranks other than 0; optimizer_data may be None to skip optimizer state.
    """
    # every node creates the directory: on multi-node without a shared filesystem each node writes its own shards
    os.makedirs(checkpoint_dir, exist_ok=True)
    model_path, meta_path, optim_path = _paths(checkpoint_dir, step, rank)
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


def is_step_complete(checkpoint_dir, step):
    model_path, meta_path, _ = _paths(checkpoint_dir, step)
    return os.path.exists(model_path) and os.path.exists(meta_path)


def _model_steps(checkpoint_dir):
    """Every step with a model_<step>.pt in a checkpoint directory, complete or not."""
    steps = set()
    for path in glob.glob(os.path.join(checkpoint_dir, "model_*.pt")):
        m = re.fullmatch(r"model_(\d+)\.pt", os.path.basename(path))
        if m:
            steps.add(int(m.group(1)))
    return steps


def complete_steps(checkpoint_dir):
    """The complete steps (model and meta both present, or a complete sharded step) in a checkpoint directory, sorted."""
    from nanochat.sharded_checkpoint import sharded_steps

    single = {s for s in _model_steps(checkpoint_dir) if is_step_complete(checkpoint_dir, s)}
    return sorted(single | set(sharded_steps(checkpoint_dir)))


def _move_aside_hint(checkpoint_dir, step):
    """What to do about a step whose files cannot be read: the earlier complete step, if there is one."""
    files = f"model_{step:06d}.pt, meta_{step:06d}.json, optim_{step:06d}_rank*.pt"
    earlier = [s for s in complete_steps(checkpoint_dir) if s < step]
    if earlier:
        return (
            f"copy it again if it came from elsewhere; or, to go back to the previous complete step {earlier[-1]}, "
            f"move step {step}'s files ({files}) out of {checkpoint_dir} and load step {earlier[-1]} "
            f"(--resume_from_step={earlier[-1]} to resume training; loading without a step then takes it)"
        )
    return f"copy it again if it came from elsewhere; there is no earlier complete step in {checkpoint_dir} to fall back to"


def _torch_load_file(path, what, checkpoint_dir, step, **kwargs):
    """torch.load that names the file and the way out when it is truncated or not a torch file at all."""
    try:
        return torch.load(path, **kwargs)
    except (PermissionError, IsADirectoryError, MemoryError):
        raise
    except Exception as e:
        why = torch_file_problem(path) or f"cannot be read ({short_error(e)})"
        also = (f" (the model of step {step} does not need it: later stages still load it)"
                if what == "optimizer state" else "")
        raise BadValue(f"checkpoint {what} {path} {why}: {_move_aside_hint(checkpoint_dir, step)}{also}") from e


def read_meta(meta_path, checkpoint_dir, step):
    """The meta dict of a step; a truncated or non-JSON file is named with the way out."""
    try:
        with open(meta_path, "r", encoding="utf-8") as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadValue(
            f"checkpoint meta {meta_path} is truncated, empty or not JSON ({short_error(e)}): "
            f"{_move_aside_hint(checkpoint_dir, step)}"
        ) from e
    if not isinstance(meta, dict):
        raise BadValue(
            f"checkpoint meta {meta_path} holds a JSON {type(meta).__name__}, not an object: "
            f"{_move_aside_hint(checkpoint_dir, step)}"
        )
    return meta


def load_checkpoint(checkpoint_dir, step, device, load_optimizer=False, rank=0):
    """
    Returns (model_state_dict, optimizer_state_dict or None, meta_dict).
    The model state dict stays on the CPU, memory-mapped from the file (mmap=True): no bytes are read until a tensor
    is used, so moving it tensor by tensor to the GPU holds one copy there and none in process memory, and an FSDP
    rank that slices its rows out of each tensor reads only those rows. The optimizer state (per rank, small) goes
    to `device`. A file that is truncated or not what it should be raises a ValueError naming it and the way out.
    """
    model_path, meta_path, optim_path = _paths(checkpoint_dir, step, rank)
    from nanochat.sharded_checkpoint import is_sharded_step_complete

    if not os.path.exists(model_path) and is_sharded_step_complete(checkpoint_dir, step):
        return _load_sharded_model(checkpoint_dir, step, load_optimizer)
    require_step(checkpoint_dir, step)
    meta_data = read_meta(meta_path, checkpoint_dir, step)
    model_data = _torch_load_file(model_path, "model", checkpoint_dir, step, map_location="cpu", mmap=True,
                                  weights_only=True)
    if not isinstance(model_data, dict):
        raise BadValue(f"checkpoint model {model_path} holds a {type(model_data).__name__}, not a state dict: "
                         f"{_move_aside_hint(checkpoint_dir, step)}")
    optimizer_data = None
    if load_optimizer:
        if not os.path.exists(optim_path):
            raise Missing(
                f"{optim_path} does not exist: optimizer state is saved per rank, so resume with the same number of "
                f"ranks as the run that wrote step {step} (or pass the model only)"
            )
        optimizer_data = _torch_load_file(optim_path, "optimizer state", checkpoint_dir, step, map_location=device,
                                          weights_only=False)
    return model_data, optimizer_data, meta_data


def _load_sharded_model(checkpoint_dir, step, load_optimizer):
    """load_checkpoint for a sharded step (nanochat/sharded_checkpoint.py): the full model assembled in this process."""
    from nanochat.sharded_checkpoint import META_FILE, read_model_state_dict, sharded_step_dir

    step_dir = sharded_step_dir(checkpoint_dir, step)
    if load_optimizer:
        raise BadValue(f"step {step} in {checkpoint_dir} is a sharded checkpoint: its optimizer state resumes on the "
                         f"FSDP path (--use_fsdp=1, any number of ranks), or consolidate it into per-rank files first "
                         f"(python -m scripts.consolidate_checkpoint)")
    meta = read_meta(os.path.join(step_dir, META_FILE.format(step=step)), checkpoint_dir, step)
    return read_model_state_dict(step_dir), None, meta


def _meta_path_of_step(checkpoint_dir, step):
    """Where step's meta json is: in its sharded folder for a complete sharded step, beside model_<step>.pt else."""
    from nanochat.sharded_checkpoint import META_FILE, is_sharded_step_complete, sharded_step_dir

    model_path, meta_path, _ = _paths(checkpoint_dir, step)
    if not os.path.exists(model_path) and is_sharded_step_complete(checkpoint_dir, step):
        return os.path.join(sharded_step_dir(checkpoint_dir, step), META_FILE.format(step=step))
    return meta_path


def require_step(checkpoint_dir, step):
    """Missing unless `step` is complete in checkpoint_dir, naming the steps there: a start-up check, run before
    anything is built, compiled or downloaded. A complete sharded step (nanochat/sharded_checkpoint.py) counts."""
    from nanochat.sharded_checkpoint import is_sharded_step_complete

    if is_sharded_step_complete(checkpoint_dir, step):
        return
    for p in _paths(checkpoint_dir, step)[:2]:
        if not os.path.exists(p):
            steps = complete_steps(checkpoint_dir) if os.path.isdir(checkpoint_dir) else []
            where = (f"complete steps in {checkpoint_dir}: {', '.join(map(str, steps))}" if steps
                     else f"{checkpoint_dir} holds no complete step" if os.path.isdir(checkpoint_dir)
                     else f"{checkpoint_dir} does not exist")
            raise Missing(f"checkpoint step {step} is incomplete or missing: {p} does not exist ({where})")


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
    meta_path = _meta_path_of_step(checkpoint_dir, step)
    vocab = (read_meta(meta_path, checkpoint_dir, step).get("model_config") or {}).get("vocab_size")
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


def step_problem(checkpoint_dir, step, with_optimizer=True):
    """
    What stops `step` from being resumed from, as a sentence, or None when it is complete. The one completeness check
    of automatic resume: a layout with other files (e.g. sharded checkpoints) adds its checks here. Reads only the
    meta and the ends of the torch files (their zip directory), not the tensors.
    """
    from nanochat.sharded_checkpoint import is_sharded_step_complete

    model_path, meta_path, _ = _paths(checkpoint_dir, step)
    if not os.path.exists(model_path) and is_sharded_step_complete(checkpoint_dir, step):
        # a sharded step (FSDP) is renamed into place only once every rank's shard, DCP's index and the meta are
        # written (nanochat/sharded_checkpoint.py): complete means resumable, model and optimizer state alike
        return None
    for path in (model_path, meta_path):
        if not os.path.exists(path):
            return f"{os.path.basename(path)} is missing (the save did not finish)"
    try:
        with open(meta_path, "r", encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        return f"{os.path.basename(meta_path)} cannot be read ({short_error(e)})"
    if not isinstance(meta, dict):
        return f"{os.path.basename(meta_path)} is not a JSON object"
    paths = [model_path]
    if with_optimizer:
        world = meta.get("world_size", 1)
        paths += [_paths(checkpoint_dir, step, r)[2] for r in range(world if isinstance(world, int) and world > 0 else 1)]
    for path in paths:
        if not os.path.exists(path):
            return f"{os.path.basename(path)} is missing"
        problem = torch_file_problem(path)
        if problem:
            return f"{os.path.basename(path)} {problem}"
    return None


def latest_resumable_step(checkpoint_dir, with_optimizer=True, log=None):
    """
    The latest step of checkpoint_dir that step_problem passes, or None when there is none (or no directory). Each
    later step it passes over is reported through `log` (default: a logger warning) with its problem.
    """
    log = log or logger.warning
    if not os.path.isdir(checkpoint_dir):
        return None
    from nanochat.sharded_checkpoint import sharded_steps

    steps = set(_model_steps(checkpoint_dir)) | set(sharded_steps(checkpoint_dir))
    for path in glob.glob(os.path.join(checkpoint_dir, "meta_*.json")):
        m = re.fullmatch(r"meta_(\d+)\.json", os.path.basename(path))
        if m:
            steps.add(int(m.group(1)))
    for step in sorted(steps, reverse=True):
        problem = step_problem(checkpoint_dir, step, with_optimizer)
        if problem is None:
            return step
        log(f"skipping checkpoint step {step} in {checkpoint_dir}: {problem}; trying the step before it")
    return None


def find_last_step(checkpoint_dir):
    """Last complete step (model and meta both present). Incomplete steps are skipped with a warning."""
    steps = _model_steps(checkpoint_dir)
    complete = complete_steps(checkpoint_dir)
    for s in sorted(steps - set(complete)):
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
    The dtype the weights of a loaded model are held in. requested: auto|bfloat16|float32, default the environment
    variable NANOCHAT_WEIGHTS_DTYPE, else auto. auto = bf16 for evaluation/inference on CUDA, fp32 otherwise:
    - CUDA eval: the matmuls run under bf16 autocast, which rounds fp32 weights to bf16 on every forward anyway, so
      bf16 weights give the same matmuls at half the memory (an fp32 d64 plus its autocast copies does not leave
      room to evaluate on one 80 GB GPU) and without the per-forward casts.
    - training keeps fp32 master weights (the optimizers need them); CPU/MPS compute in fp32 (bf16 matmuls on CPU are
      ~10x slower), so bf16 checkpoints written on a GPU are widened there.
    """
    requested = requested or os.environ.get("NANOCHAT_WEIGHTS_DTYPE") or "auto"
    if requested not in WEIGHTS_DTYPES:
        raise BadValue(f"weights dtype must be one of {'|'.join(WEIGHTS_DTYPES)} (NANOCHAT_WEIGHTS_DTYPE), got {requested!r}")
    if WEIGHTS_DTYPES[requested] is not None:
        return WEIGHTS_DTYPES[requested]
    return torch.bfloat16 if device_type == "cuda" and phase == "eval" else torch.float32


def model_from_state_dict(model_data, config, device, dtype=torch.float32):
    """
    A GPT holding `model_data` on `device`, built without a second copy of the weights: the modules are made on the
    meta device (no memory), each checkpoint tensor is moved/cast once and assigned into place, and only the derived
    buffers (rotary tables) are computed on the device. (to_empty() + init_weights() before loading would hold two
    full copies on the device at once.) Floating tensors are cast to `dtype`.
    """
    from nanochat.gpt import GPT

    device = torch.device(device)
    state = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in model_data.items()}
    with torch.device("meta"):
        model = GPT(config)
    model.load_state_dict(state, strict=True, assign=True)
    model.init_buffers()  # rotary tables on the device, attention backend for it
    return model


SHAPE_FIELDS = ("vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd")  # the GPTConfig fields that shape weights


def model_config_from_meta(meta, meta_path):
    """The GPTConfig a meta's model_config describes; a missing or foreign one names the file."""
    from nanochat.gpt import GPTConfig

    cfg = meta.get("model_config")
    if not isinstance(cfg, dict):
        raise BadValue(
            f"checkpoint meta {meta_path} has no model_config object (its keys: {sorted(meta)}), so the model cannot "
            f"be rebuilt: it was not written by nanochat's save_checkpoint; copy the meta of that step again"
        )
    try:
        return GPTConfig(**cfg)
    except TypeError as e:
        raise BadValue(f"the model_config in {meta_path} is not a GPTConfig ({e}): {cfg}") from e


def checkpoint_model_config(source, model_tag, step):
    """The GPTConfig a saved step was built with, from its meta alone (no tensor is read), checked: what the start-up
    checks of a model's shape (sequence length, tensor parallelism) read before the model loads."""
    from nanochat.gpt import check_config

    checkpoint_dir = os.path.join(checkpoint_root(source), model_tag)
    meta_path = _meta_path_of_step(checkpoint_dir, step)
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
    from nanochat.gpt import GPT

    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in GPT(config).state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state_dict.items()}
    if expected == got:
        return
    missing, unexpected = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
    shapes = [k for k in expected if k in got and expected[k] != got[k]]
    detail = []
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
    model_path, meta_path, _ = _paths(checkpoint_dir, step)
    config = model_config_from_meta(meta, meta_path)
    model_data = clean_state_dict(model_data)
    check_weights_match_config(model_data, config, model_path, meta_path)
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
