"""
Training recipes (`base_train --recipe`): the model and every default of base training that goes with it, in one
table, so one flag selects a whole recipe and an explicit flag still overrides any single value.

    recipe = resolve_recipe(config)                       # fills the flags left on auto from RECIPES, checks the rest
    model_config = recipe.model_config(config, vocab_size)
    batch = recipe.batch(config, model_config)            # tokens per step, scaled learning rates and weight decay
    lrm, momentum, weight_decay = recipe.schedule(step, num_iterations)

- `december` (the default): nanochat bc51da8, the recipe this project has trained since it began: GPT (nanochat/gpt.py),
  nanochat's depth rule, the learning rates as given, warmdown 20%, Muon momentum 0.85 -> 0.95 over 300 steps,
  gradient clipping at 1.0, 20 tokens per parameter.
- `record`: nanochat 92d63d4's base_train (the time-to-GPT-2 record, its dev/LEADERBOARD.md): RecordGPT with sliding
  windows (SSSL), head dim 128 (width depth x 64 rounded up to whole heads), 12 tokens per scaling parameter (block
  matrices + lm_head), and from that horizon, as there: the batch size (Power Lines, B ~ D^0.383 from 2^19 tokens at
  d12, to a power of two), every learning rate scaled by sqrt(B / 2^19), the Muon weight decay 0.28 scaled by
  sqrt(B / 2^19) * D_d12 / D; 40 warmup steps, warmdown 65% to 5%, Muon momentum 0.85 -> 0.97 over 400 steps and down
  to 0.90 over the warmdown, the Muon weight decay cosine-decayed to 0, no gradient clipping, 80 x 2^19 validation
  tokens. The same explicit flags give the same run as 92d63d4's base_train (flag names here use underscores).

The recipe is recorded in the checkpoint meta ("recipe"), the run's metrics (system/recipe) and the report. Which
model a checkpoint holds is read from its model_config alone (nanochat/gpt.py config_from_dict), so every script that
loads one builds the right model whatever recipe made it.
"""

import math

import torch

from nanochat.configurator import Flag, Rule
from nanochat.gpt import RecordConfig, RecordGPT, config_for_depth, config_from_dict, record_config_for_depth
from nanochat.training import DEFAULT_EVAL_TOKENS, lr_multiplier, muon_momentum
from nanochat.usage import BadValue

RECIPE_NAMES = ("december", "record")
B_REF = 2**19  # the record recipe's reference batch (tokens), measured optimal at d12 by nanochat
D_REF_DEPTH = 12  # the depth whose compute-optimal horizon the record recipe scales from
RECORD_EVAL_TOKENS = 80 * 524288

# The default of every base_train flag that depends on the recipe (flags left on auto take it). None: worked out
# from the model (record's batch size); a flag missing from a recipe's row does not apply to it (refused if given).
RECIPES = {
    "december": dict(init="normal", target_param_data_ratio=20, total_batch_size=524288, embedding_lr=0.2,
                     unembedding_lr=0.004, matrix_lr=0.02, weight_decay=0.0, grad_clip=1.0, warmup_ratio=0.0,
                     warmup_steps=0, warmdown_ratio=0.2, final_lr_frac=0.0),
    "record": dict(init="record", target_param_data_ratio=12, total_batch_size=None, embedding_lr=0.3,
                   unembedding_lr=0.008, matrix_lr=0.02, weight_decay=0.28, grad_clip=0.0, warmup_ratio=0.0,
                   warmup_steps=40, warmdown_ratio=0.65, final_lr_frac=0.05, scalar_lr=0.5, window_pattern="SSSL",
                   head_dim=128, aspect_ratio=64),
}


def recipe_flags():
    """base_train's flags whose defaults are the recipe's (auto = RECIPES[--recipe]), and --recipe itself."""
    def auto(flag):
        values = ", ".join(f"{name} {RECIPES[name][flag] if RECIPES[name].get(flag) is not None else 'from the horizon'}"
                           for name in RECIPE_NAMES if flag in RECIPES[name])
        return f"; auto = the recipe's ({values})"

    return [
        Flag("recipe", "december", "the training recipe, every default below with it: december (nanochat bc51da8, "
             "the GPT this project trains) or record (nanochat 92d63d4's time-to-GPT-2 record: sliding windows, value "
             "embeddings, its optimizer groups and schedules; nanochat/recipe.py)", choices=list(RECIPE_NAMES)),
        Flag("init", None, "weight init: normal (arXiv 2310.17813's scaling), nanochat (its exact December scheme) or "
             "record (92d63d4's, the record model's only one)" + auto("init"), type=str,
             choices=["normal", "nanochat", "record"]),
        Flag("head_dim", None, "record: attention head width; the model width depth x aspect_ratio is rounded up to "
             "whole heads" + auto("head_dim"), type=int, min=2, check=check_head_dim),
        Flag("aspect_ratio", None, "record: model width per layer of depth" + auto("aspect_ratio"), type=int, min=1),
        Flag("window_pattern", None, "record: sliding-window pattern tiled over the layers, S = a quarter of the "
             "context, L = all of it; the last layer is always L (e.g. SSSL, L)" + auto("window_pattern"), type=str,
             check=check_window_pattern),
        Flag("target_param_data_ratio", None, "train on ratio x parameters tokens (record: x the block matrices and "
             "lm_head)" + auto("target_param_data_ratio"), type=float),
        Flag("total_batch_size", None, "tokens per optimisation step, over all ranks and micro-steps"
             + auto("total_batch_size"), type=int, min=1),
        Flag("embedding_lr", None, "learning rate of the token embedding (AdamW)" + auto("embedding_lr"), type=float,
             min=0.0),
        Flag("unembedding_lr", None, "learning rate of the lm_head (AdamW)" + auto("unembedding_lr"), type=float,
             min=0.0),
        Flag("matrix_lr", None, "learning rate of the transformer's matrices (Muon; AdamW with --use_muon=0)"
             + auto("matrix_lr"), type=float, min=0.0),
        Flag("weight_decay", None, "weight decay: of the AdamW groups (december), Muon's cautious decay (record)"
             + auto("weight_decay"), type=float, min=0.0),
        Flag("scalar_lr", None, "record: learning rate of the per-layer scalars (AdamW)" + auto("scalar_lr"),
             type=float, min=0.0),
        Flag("grad_clip", None, "clip the gradient norm to this (<= 0: no clipping)" + auto("grad_clip"), type=float),
        Flag("warmup_ratio", None, "fraction of the steps spent warming the learning rate up from 0"
             + auto("warmup_ratio"), type=float, min=0.0, max=1.0),
        Flag("warmup_steps", None, "steps spent warming the learning rate up (instead of --warmup_ratio)"
             + auto("warmup_steps"), type=int, min=0),
        Flag("warmdown_ratio", None, "fraction of the steps at the end spent decaying the learning rate"
             + auto("warmdown_ratio"), type=float, min=0.0, max=1.0),
        Flag("final_lr_frac", None, "learning rate at the end of the warmdown, as a fraction of the peak"
             + auto("final_lr_frac"), type=float, min=0.0, max=1.0),
        WARMUP_RULE,
        Rule(("warmup_ratio", "warmup_steps"), lambda ratio, steps: not (ratio and steps),
             "set one of --warmup_ratio and --warmup_steps (each is the whole warmup), not both (got {warmup_ratio} "
             "and {warmup_steps})"),
        Rule(("recipe", "init"), lambda recipe, init: (recipe == "record") == (init == "record"),
             "--init={init} is not an init of the {recipe} model: the december model takes normal or nanochat, the "
             "record model only record (got --recipe={recipe})"),
        Rule(("recipe", "use_muon"), lambda recipe, use_muon: recipe != "record" or use_muon,
             "the record recipe trains its block matrices with Muon: --use_muon=0 is december's option (got "
             "--recipe={recipe})"),
        *[Rule(("recipe", flag), lambda recipe, _: recipe == "record",
               f"--{flag} is part of the record recipe, not {{recipe}}: drop it, or add --recipe=record (got "
               f"--recipe={{recipe}})") for flag in RECORD_ONLY],
    ]


RECORD_ONLY = sorted(RECIPES["record"].keys() - RECIPES["december"].keys())  # refused with --recipe=december


def check_head_dim(head_dim):
    if head_dim % 2:
        raise ValueError(f"--head_dim must be an even number >= 2 (rotary embeddings rotate pairs), got {head_dim}")


def check_window_pattern(pattern):
    if not pattern or set(pattern.upper()) - set("SL"):
        raise ValueError(f"--window_pattern must be a non-empty string of S (short window) and L (whole context), e.g. "
                         f"SSSL or L, got {pattern!r}")


WARMUP_RULE = Rule(("warmup_ratio", "warmdown_ratio"), lambda up, down: up + down <= 1,
                   "--warmup_ratio + --warmdown_ratio must be <= 1: the warmup and the warmdown are parts of the same "
                   "run (got {warmup_ratio} + {warmdown_ratio})")


def resolve_recipe(config):
    """
    Fill config's recipe flags left on auto (None) from RECIPES[config["recipe"]], in place, and return the Recipe.
    What the parser could not check while a value was auto is checked here (BadValue): the warmup and warmdown the
    recipe fills in must not overlap. (A flag the recipe has no use for, e.g. --window_pattern with december, two
    warmups, an init of the other model: recipe_flags' rules, checked while parsing.)
    """
    name = config["recipe"]
    row = RECIPES[name]
    if config.get("warmup_ratio") is not None and config.get("warmup_steps") is None:
        config["warmup_steps"] = 0  # the warmup the user gave replaces the recipe's
    if config.get("warmup_steps") is not None and config.get("warmup_ratio") is None:
        config["warmup_ratio"] = 0.0
    for flag, value in row.items():
        if config.get(flag) is None:
            config[flag] = value
    WARMUP_RULE.check(config)
    return Recipe(name, config)


class Batch:
    """What the recipe makes of the batch flags for a model: tokens per step and the optimizer's scaled arguments."""

    def __init__(self, total_batch_size, optimizer_kwargs, notes=()):
        self.total_batch_size, self.optimizer_kwargs, self.notes = total_batch_size, optimizer_kwargs, list(notes)


class Recipe:
    def __init__(self, name, config):
        self.name, self.config = name, config
        self.weight_decay = None  # the record recipe's scaled Muon weight decay (batch()), scheduled per step

    @property
    def record(self):
        return self.name == "record"

    @property
    def packing(self):
        """--packing=auto: nanochat 92d63d4 packs best-fit rows that start at a document; December concatenates."""
        return "bestfit" if self.record else "concat"

    @property
    def data_source(self):
        """--data=auto: 92d63d4 trains on ClimbMix (base_data_climbmix/); December on FineWeb-Edu (base_data/)."""
        return "climbmix" if self.record else "fineweb_edu"

    @property
    def eval_tokens(self):
        """The validation tokens --eval_tokens=auto means (before the CPU cut, training.eval_steps_for)."""
        return RECORD_EVAL_TOKENS if self.record else DEFAULT_EVAL_TOKENS

    def model_config(self, config, vocab_size):
        """The model's config for --depth (BadValue naming the flags when the shape rule refuses them)."""
        try:
            if self.record:
                return record_config_for_depth(config["depth"], vocab_size, config["max_seq_len"], config["aspect_ratio"],
                                               config["head_dim"], config["window_pattern"])
            return config_for_depth(config["depth"], vocab_size, config["max_seq_len"])
        except ValueError as e:
            raise BadValue(str(e)) from None

    def horizon_params(self, model):
        """The parameter count --target_param_data_ratio multiplies: all of them (december), the scaling ones (record)."""
        return model.scaling_params() if self.record else model.num_params()

    def batch(self, config, model_config):
        """
        Tokens per step and setup_optimizers' arguments. december: --total_batch_size and the learning rates as
        given. record (92d63d4's scaling, see the module doc): the batch from the horizon when --total_batch_size is
        auto, the learning rates times sqrt(B / 2^19), the Muon weight decay times sqrt(B / 2^19) * D_d12 / D.
        """
        if not self.record:
            return Batch(config["total_batch_size"], {})
        ratio = config["target_param_data_ratio"]
        if ratio <= 0:
            raise BadValue("the record recipe scales its batch size, learning rates and weight decay from the "
                           "--target_param_data_ratio horizon: give it a value > 0 (--num_iterations still sets the "
                           "number of steps)")
        target_tokens = int(ratio * scaling_params(model_config))
        ref = record_config_for_depth(D_REF_DEPTH, model_config.vocab_size, model_config.sequence_len,
                                      config["aspect_ratio"], config["head_dim"], config["window_pattern"])
        d_ref = ratio * scaling_params(ref)
        notes = []
        total = config["total_batch_size"]
        if total is None:
            total = 2 ** round(math.log2(B_REF * (target_tokens / d_ref) ** 0.383))
            notes.append(f"Batch size from the horizon ({target_tokens:,} tokens; d{D_REF_DEPTH}: {d_ref:,.0f}): "
                         f"{total:,} tokens")
        lr_scale = (total / B_REF) ** 0.5 if total / B_REF != 1.0 else 1.0
        self.weight_decay = config["weight_decay"] * math.sqrt(total / B_REF) * (d_ref / target_tokens)
        notes.append(f"Learning rates x {lr_scale:.4f} for the batch of {total:,} (reference {B_REF:,}); Muon weight "
                     f"decay {config['weight_decay']} -> {self.weight_decay:.6f}")
        kwargs = dict(unembedding_lr=config["unembedding_lr"] * lr_scale, embedding_lr=config["embedding_lr"] * lr_scale,
                      scalar_lr=config["scalar_lr"] * lr_scale, matrix_lr=config["matrix_lr"] * lr_scale,
                      weight_decay=self.weight_decay)
        return Batch(total, kwargs, notes)

    def schedule(self, step, num_iterations):
        """(learning-rate multiplier, Muon momentum, Muon weight decay or None = leave as set) for a step."""
        c = self.config
        lrm = lr_multiplier(step, num_iterations, c["warmup_ratio"], c["warmdown_ratio"], c["final_lr_frac"],
                            warmup_steps=c["warmup_steps"])
        if not self.record:
            return lrm, muon_momentum(step), None
        return lrm, record_momentum(step, num_iterations, c["warmdown_ratio"]), \
            self.weight_decay * 0.5 * (1 + math.cos(math.pi * step / num_iterations))


def checkpoint_recipe(meta):
    """The recipe that made a checkpoint: its meta's "recipe" (base_train writes it; mid_train, chat_sft and chat_rl
    copy their source's), else, for a checkpoint from before that key, the one its model_config describes: record
    for the record model (nanochat/gpt.py config_from_dict), december otherwise."""
    if meta.get("recipe"):
        return meta["recipe"]
    cfg = meta.get("model_config")
    return "record" if isinstance(cfg, dict) and isinstance(config_from_dict(cfg), RecordConfig) else "december"


def training_data(meta):
    """(--data, --packing) of the base run a checkpoint comes from: its user_config's, else (a checkpoint from before
    those flags, or a later stage's meta) its recipe's defaults; what base_loss measures a model on by default."""
    recipe = Recipe(checkpoint_recipe(meta), {})
    user_config = meta.get("user_config") or {}
    return user_config.get("data") or recipe.data_source, user_config.get("packing") or recipe.packing


def record_momentum(step, num_iterations, warmdown_ratio):
    """The record recipe's Muon momentum: 0.85 -> 0.97 over the first 400 steps, 0.97 -> 0.90 over the warmdown."""
    warmdown_iters = round(warmdown_ratio * num_iterations)
    warmdown_start = num_iterations - warmdown_iters
    if step < 400:
        frac = step / 400
        return (1 - frac) * 0.85 + frac * 0.97
    if step >= warmdown_start:
        progress = (step - warmdown_start) / warmdown_iters
        return 0.97 * (1 - progress) + 0.90 * progress
    return 0.97


def scaling_params(model_config):
    """RecordGPT.scaling_params of a config, from a model on the meta device (no memory, no init)."""
    with torch.device("meta"):
        return RecordGPT(model_config).scaling_params()
