"""
Data plumbing shared by the chat stages (mid-training, SFT; RL uses the model loading and saving part).

Mid-training (`ConversationPacker`): conversations are rendered with `tokenizer.render_conversation` (each one
starts with <|bos|>) and concatenated into one token stream, which is cut into (B, T) rows. Every token is a
target, as in nanochat: mid-training teaches the chat format, multiple choice and tool use from whole
conversations, and packing wastes no compute on padding.

SFT (`sft_batches`, `collate_sft`): one conversation per row, padded to the longest row of the batch. Targets are
-1 wherever the render mask is 0 (system/user turns, the tool outputs the engine forces at inference time) and on
the padding, so the loss is exactly the assistant's own tokens.

Stage setup: `load_stage_model` (load the previous stage's checkpoint, or say which command makes one) and
`scale_initial_lr`; saving a stage's model is nanochat.checkpoint.train_state.save_stage_model. Which tasks a stage
trains and validates on, and how they become one mixture, is tasks/suites.py: this library never imports tasks/ (the
scripts pass the tasks in).

Under torchrun every rank looks for the task data itself (local files, a hub probe), so ranks could disagree about
what exists: one would then evaluate or train on a task another left out, and their collectives would pair up wrong
or hang. `build_on_every_rank` makes that decision collective (a task is used only if every rank has it, and has it
the same size), and `raise_on_every_rank` (nanochat/distributed/dist.py) turns an error one rank hits before a collective into
an error on every rank. In a single process both do nothing more than the plain code would.
"""

import torch
import torch.distributed as dist

from nanochat.common import get_base_dir
from nanochat.data.task_data import TaskDataNotFound
from nanochat.distributed.dist import collective_device, dist_world_size, raise_on_every_rank
from nanochat.usage import BadValue, Missing

# the command that produces each checkpoint source, for "no checkpoint" errors
STAGE_COMMANDS = {
    "base": "python -m scripts.base_train",
    "mid": "python -m scripts.mid_train",
    "sft": "python -m scripts.chat_sft",
    "rl": "python -m scripts.chat_rl",
}


# -----------------------------------------------------------------------------
# agreeing across ranks


def build_on_every_rank(name, build):
    """
    build() on this rank -> the task, decided the same way on every rank. In one process this is just build().
    Under torchrun (world > 1) it is collective (every rank must call it, for the same tasks in the same order):
    - a rank whose build() raised anything but TaskDataNotFound makes every rank raise (`raise_on_every_rank`);
    - if any rank raised TaskDataNotFound, every rank raises TaskDataNotFound: its own where no rank found the data,
      else one naming the ranks that lacked it and where they looked (the task is used only if every rank has it);
    - if every rank built it but the sizes differ (ranks read different copies of the data), every rank raises
      ValueError.
    """
    world = dist_world_size()
    task = not_found = error = None
    try:
        task = build()
    except TaskDataNotFound as e:
        not_found = e
    except Exception as e:
        if world == 1:
            raise
        error = e
    if world == 1:
        if not_found is not None:
            raise not_found
        return task
    raise_on_every_rank(error, f"loading {name}")
    size = torch.tensor([-1 if task is None else len(task)], dtype=torch.long, device=collective_device())
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    sizes = [int(s.item()) for s in sizes]
    lacking = [r for r, s in enumerate(sizes) if s < 0]
    if len(lacking) == world:
        raise not_found
    if lacking:
        looked = [None] * world
        dist.all_gather_object(looked, None if not_found is None else not_found.looked)
        ranks = ", ".join(map(str, lacking))
        raise TaskDataNotFound(
            f"{name} on rank(s) {ranks} (the other ranks found it, but a task is used only if every rank has it)",
            [f"rank {r}: {place}" for r in lacking for place in looked[r]],
        )
    if len(set(sizes)) > 1:
        raise ValueError(f"{name} has a different size on each rank ({', '.join(f'rank {r}: {s:,}' for r, s in enumerate(sizes))}): "
                         f"every rank must read the same copy of its data (check NANOCHAT_DATA_DIR on every node)")
    return task


# -----------------------------------------------------------------------------
# mid-training: packed conversations


def _to_device(t, device):
    device = torch.device(device)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class ConversationPacker:
    """
    Iterator of (inputs, targets), int64 (B, T) on `device`: the rendered conversations of `dataset` taken in order
    (this rank takes examples rank, rank + world_size, ...), concatenated into one stream and cut every B*T tokens.
    Batch k holds stream[k*B*T : (k+1)*B*T] as inputs and the same shifted by one as targets, so every token is the
    input exactly once and nothing is dropped at batch boundaries. It passes over the dataset again and again;
    `epoch` counts the passes this rank has started beyond the first and `progress` is the fraction of the dataset
    rendered so far (1.0 = one epoch), for the LR schedule and the one-epoch stopping rule.
    """

    def __init__(self, dataset, tokenizer, B, T, device="cpu", rank=0, world_size=1, max_conversation_tokens=None):
        if len(dataset) == 0:
            raise ValueError("ConversationPacker needs a non-empty dataset")
        if B < 1 or T < 1:
            raise ValueError(f"batch shape must be positive, got B={B}, T={T}")
        self.dataset, self.tokenizer = dataset, tokenizer
        self.B, self.T, self.device = B, T, device
        self.world_size = world_size
        self.max_conversation_tokens = max_conversation_tokens
        self.cursor = rank  # the next example this rank renders
        self.epoch = 0
        self.buffer = []

    @property
    def progress(self):
        return self.epoch + min(self.cursor / len(self.dataset), 1.0)

    def _render_next(self):
        if self.cursor >= len(self.dataset):  # wrap around: start the next pass over the data
            self.cursor -= len(self.dataset)
            self.epoch += 1
        conversation = self.dataset[self.cursor]
        self.cursor += self.world_size
        kwargs = {} if self.max_conversation_tokens is None else {"max_tokens": self.max_conversation_tokens}
        ids, _ = self.tokenizer.render_conversation(conversation, **kwargs)
        return ids

    def __iter__(self):
        return self

    def __next__(self):
        n = self.B * self.T
        while len(self.buffer) < n + 1:  # one token more: the target of the last input
            self.buffer.extend(self._render_next())
        chunk = torch.tensor(self.buffer[: n + 1], dtype=torch.long)
        del self.buffer[:n]  # the extra token stays: it is the first input of the next batch
        inputs = chunk[:-1].view(self.B, self.T)
        targets = chunk[1:].view(self.B, self.T)
        return _to_device(inputs, self.device), _to_device(targets, self.device)


# -----------------------------------------------------------------------------
# SFT: one conversation per row, loss on the assistant tokens only


def collate_sft(rows, pad_id):
    """
    rows: list of (ids, mask) from render_conversation. Returns CPU int64 (inputs, targets) of shape (len(rows), L-1)
    with L the longest row: inputs = ids[:-1] padded with pad_id; targets = ids[1:] where mask[1:] is 1, -1 where the
    mask is 0 and on the padding.
    """
    if not rows:
        raise ValueError("collate_sft needs at least one row")
    width = max(len(ids) for ids, _ in rows) - 1
    if width < 1:
        raise ValueError("every conversation rendered to a single token: nothing to train on")
    inputs = torch.full((len(rows), width), pad_id, dtype=torch.long)
    targets = torch.full((len(rows), width), -1, dtype=torch.long)
    for i, (ids, mask) in enumerate(rows):
        if len(ids) != len(mask):
            raise ValueError(f"row {i}: {len(ids)} ids but {len(mask)} mask entries")
        n = len(ids) - 1
        ids_t = torch.tensor(ids, dtype=torch.long)
        mask_t = torch.tensor(mask, dtype=torch.bool)
        inputs[i, :n] = ids_t[:-1]
        row_targets = ids_t[1:].clone()
        row_targets[~mask_t[1:]] = -1  # mask[j+1] says whether token j+1 (the target at position j) is trained
        targets[i, :n] = row_targets
    return inputs, targets


def sft_batches(dataset, tokenizer, B, device="cpu", rank=0, world_size=1, max_tokens=2048):
    """
    Endless iterator of (inputs, targets) on `device`, B conversations per batch: this rank takes examples rank,
    rank + world_size, ... of `dataset`, pass after pass. Rows are padded with <|assistant_end|> (never a target).
    Conversations are cut at max_tokens; one cut before its first assistant token has nothing to train and is
    skipped (it would only cost compute). Under torchrun the first next() is collective: a rank whose share has
    nothing to train on makes every rank raise there, instead of leaving the others waiting in the first backward.
    """
    batches = _sft_batches(dataset, tokenizer, B, device, rank, world_size, max_tokens)
    if world_size == 1 or dist_world_size() == 1:
        yield from batches
        return
    first = error = None
    try:
        first = next(batches)  # a share with nothing to train raises here, before any batch (passes all look alike)
    except Exception as e:
        error = e
    raise_on_every_rank(error, "making the SFT batches")
    yield first
    yield from batches


def _sft_batches(dataset, tokenizer, B, device, rank, world_size, max_tokens):
    if len(dataset) < world_size:
        raise ValueError(f"{len(dataset)} conversations cannot be split over {world_size} ranks")
    pad_id = tokenizer.encode_special("<|assistant_end|>")
    rows = []
    while True:
        trainable = 0
        for i in range(rank, len(dataset), world_size):
            ids, mask = tokenizer.render_conversation(dataset[i], max_tokens=max_tokens)
            if not any(mask[1:]):
                continue
            trainable += 1
            rows.append((ids, mask))
            if len(rows) == B:
                inputs, targets = collate_sft(rows, pad_id)
                rows = []
                yield _to_device(inputs, device), _to_device(targets, device)
        if trainable == 0:
            raise ValueError(f"no conversation of this rank's share has an assistant token within max_tokens={max_tokens}")


# -----------------------------------------------------------------------------
# loading the previous stage, saving this one


def check_stage_model(source, model_tag=None, model_step=None):
    """
    The start-up check of a post-training script, before anything is built: (model_tag, step) of the checkpoint it
    will load, with the flags as the scripts take them (None, "" or -1 = the latest). A missing one is a usage error
    that says which command makes it.
    """
    from nanochat.checkpoint_manager import checkpoint_root, resolve_checkpoint

    try:
        return resolve_checkpoint(source, model_tag or None, None if model_step is None or model_step < 0 else model_step)
    except FileNotFoundError as e:
        raise Missing(
            f"cannot load the {source} model ({e}). Checkpoints are looked for in {checkpoint_root(source)}; "
            f"make one with `{STAGE_COMMANDS[source]}` (with NANOCHAT_BASE_DIR={get_base_dir()})."
        ) from e


def load_stage_model(source, device, model_tag=None, model_step=None, phase="train"):
    """checkpoint_manager.load_model of the checkpoint check_stage_model finds."""
    from nanochat.checkpoint_manager import load_model

    tag, step = check_stage_model(source, model_tag, model_step)
    return load_model(source, device, phase, model_tag=tag, step=step)


def scale_initial_lr(optimizers, frac):
    """Start fine-tuning at a fraction of the pretraining learning rates: every group's lr and initial_lr *= frac
    (the schedule then multiplies initial_lr)."""
    if frac <= 0:
        raise BadValue(f"--init_lr_frac must be > 0, got {frac}")
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * frac
            group["initial_lr"] = group["lr"]
