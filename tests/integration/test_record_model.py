"""
The record recipe's model (nanochat/gpt.py RecordGPT) and its recipe (nanochat/recipe.py, base_train --recipe=record),
against nanochat 92d63d4's own code where it can be run (its tarball in ../shared/bench, or NANOCHAT_ANCHOR_92D63D4;
those tests skip without it):

- the model: the same init from the same seed (bit for bit), the same logits and loss with sliding windows active,
  the same windows, FLOPs, scaling parameters and optimizer groups (every hyperparameter, by parameter name)
- the recipe: every default 92d63d4's base_train has, its batch-size / lr / weight-decay scaling and its schedules,
  run from its own source
- the KV cache: generation with the cache (eager and fixed-shape decode, a chunked prefill) equals full forwards
  without one, for prompts longer than the short window and past sequence_len (where the long window slides too)
- checkpoints both ways (slow): a checkpoint written by 92d63d4's base_train loads here with the same logits (1e-5)
  and greedy tokens for 5 prompts; ours (base_train --recipe=record) loads in 92d63d4 with the same
- the recipe in meta, metrics and report; every loader builds the record model from the meta alone (checkpoint_manager,
  chat_cli end to end); export_hf refuses it in one line; resuming it under the other recipe is refused
The layouts (FSDP, TP) are in tests/distributed/test_record_layouts.py; the windows of every attention backend in
tests/unit/test_attention.py.
"""

import ast
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from conftest import REPO, subprocess_env
from test_posttrain import chat_env  # noqa: F401  (a fixture: tokenizer and task data for the post-training chain)
from nanochat.engine import Engine, KVCache
from nanochat.gpt import GPT, GPTConfig, RecordConfig, RecordGPT, config_from_dict, window_sizes
from nanochat.recipe import RECIPES, checkpoint_recipe, resolve_recipe, training_data

ANCHOR = Path(os.environ.get("NANOCHAT_ANCHOR_92D63D4", REPO.parent / "shared" / "bench" / "nanochat-92d63d4.tar.gz"))
SCRIPTS = Path(__file__).resolve().parents[1] / "anchor_scripts"
PROMPTS = ["The capital of France is", "The chemical symbol of gold is", "If yesterday was Friday, then tomorrow will be",
           "The opposite of hot is", "The planets of the solar system are:"]

# windows: SSSL at 512 -> short 128, long 512; 5 layers: value embeddings on 0, 2, 4, backout after layer 2; GQA
MODEL_CONFIG = dict(sequence_len=512, vocab_size=300, n_layer=5, n_head=4, n_kv_head=2, n_embd=128, window_pattern="SSSL")
OPTIMIZER_KWARGS = dict(unembedding_lr=0.008, embedding_lr=0.3, matrix_lr=0.02, weight_decay=0.2, scalar_lr=0.5)
# base_train's scaling on 92d63d4's leaderboard run (d24, ratio 8), its d12 reference, another vocab and pattern, the
# CPU run of ../shared/bench/README.md (explicit batch), an explicit batch of 2^19
SCALING = [(24, 8.0, -1, 128, 2048, 32768, 0.28, "SSSL"), (12, 12.0, -1, 128, 2048, 32768, 0.28, "SSSL"),
           (20, 10.5, -1, 128, 2048, 65536, 0.28, "SSL"), (4, 12.0, 2048, 64, 256, 512, 0.28, "SSSL"),
           (26, 12.0, 524288, 128, 2048, 32768, 0.2, "L")]
SCHEDULES = [(1000, 40, 0.65, 0.05, 0.3), (6, 2, 0.65, 0.05, 0.45), (500, 0, 0.5, 0.0, 0.1)]


def anchor_dir(tmp_path_factory):
    if not ANCHOR.is_file():
        pytest.skip(f"nanochat 92d63d4's tarball is not at {ANCHOR} (../shared/bench beside the repo, or set "
                    f"NANOCHAT_ANCHOR_92D63D4)")
    root = tmp_path_factory.mktemp("anchor")
    with tarfile.open(ANCHOR) as tar:
        tar.extractall(root, filter="data")
    d = root / "nanochat-92d63d4"
    for pkg in ("scripts", "tasks"):  # regular packages, so the project's editable install does not shadow them
        (d / pkg / "__init__.py").touch()
    return d


def run_anchor(anchor, args, base_dir=None, timeout=600):
    """A python process in 92d63d4's directory (its nanochat first on sys.path), eager (no torch.compile)."""
    env = subprocess_env(base_dir, TORCHDYNAMO_DISABLE=1)
    env["PYTHONPATH"] = str(anchor)
    p = subprocess.run([sys.executable, *map(str, args)], cwd=anchor, env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


@pytest.fixture(scope="module")
def anchor(tmp_path_factory):
    return anchor_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def probe(anchor, tmp_path_factory):
    """What 92d63d4's code computes (tests/anchor_scripts/probe_92d63d4.py) for MODEL_CONFIG, SCALING and SCHEDULES."""
    d = tmp_path_factory.mktemp("probe")
    cases = {"model_config": MODEL_CONFIG, "optimizer_kwargs": OPTIMIZER_KWARGS,
             "scaling": [{"depth": depth, "vocab_size": vocab, "args": dict(
                 aspect_ratio=64, head_dim=head_dim, max_seq_len=seq, window_pattern=pattern,
                 target_param_data_ratio=ratio, total_batch_size=batch, weight_decay=wd)}
                 for depth, ratio, batch, head_dim, seq, vocab, wd, pattern in SCALING],
             "schedules": [{"num_iterations": n, "weight_decay_scaled": wd, "args": dict(
                 warmup_steps=warmup, warmdown_ratio=warmdown, final_lr_frac=final)}
                 for n, warmup, warmdown, final, wd in SCHEDULES]}
    (d / "cases.json").write_text(json.dumps(cases))
    run_anchor(anchor, [SCRIPTS / "probe_92d63d4.py", anchor, d / "cases.json", d / "probe.pt"])
    return torch.load(d / "probe.pt", weights_only=False)


def record_model(attn="sdpa", **overrides):
    torch.manual_seed(0)
    with torch.device("meta"):
        model = RecordGPT(RecordConfig(**dict(MODEL_CONFIG, **overrides)), attn=attn)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


# -----------------------------------------------------------------------------
# the model against 92d63d4's


@pytest.mark.slow  # 92d63d4's model built beside ours: seconds
def test_same_init_logits_windows_flops_as_92d63d4(probe):
    model = record_model()
    init = model.state_dict()
    assert init.keys() == probe["init"].keys()  # its parameter names: checkpoints load by name both ways
    for k, v in probe["init"].items():
        assert torch.equal(init[k], v), k  # same seed, same generator draws in the same order
    model.load_state_dict(probe["perturbed"])
    with torch.no_grad():
        logits, loss = model(probe["idx"]), model(probe["idx"], probe["idx"])
    torch.testing.assert_close(logits, probe["logits"], atol=1e-5, rtol=0)
    torch.testing.assert_close(loss, probe["loss"], atol=1e-6, rtol=0)
    assert model.windows == probe["windows"] == [128, 128, 128, 512, 512]  # the windows mattered (rows of 512)
    assert model.estimate_flops() == probe["flops"] and model.scaling_params() == probe["scaling_params"]


@pytest.mark.slow  # unpacks and runs 92d63d4's code (its probe: seconds)
def test_same_optimizer_groups_as_92d63d4(probe):
    model = record_model()
    names = {id(p): n for n, p in model.named_parameters()}
    ours = {names[id(p)]: g for g in model.optimizer_groups(**OPTIMIZER_KWARGS) for p in g["params"]}
    assert ours.keys() == probe["groups"].keys()
    for name, theirs in probe["groups"].items():
        mine = ours[name]
        keys = ("lr", "betas", "eps", "weight_decay") if theirs["kind"] == "adamw" else \
            ("lr", "momentum", "ns_steps", "beta2", "weight_decay")
        assert mine["kind"] == theirs["kind"], name
        assert {k: mine[k] for k in keys} == {k: theirs[k] for k in keys}, name


@pytest.mark.slow  # unpacks and runs 92d63d4's code (its probe: seconds)
def test_record_defaults_are_92d63d4s_base_train_defaults(anchor):
    tree = ast.parse((anchor / "scripts" / "base_train.py").read_text())
    theirs = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            name = node.args[0].value.removeprefix("--").replace("-", "_")
            default = [k.value for k in node.keywords if k.arg == "default"]
            if default:
                theirs[name] = eval(compile(ast.Expression(default[0]), "<default>", "eval"))
    row = RECIPES["record"]
    for flag, value in row.items():
        if flag in ("init", "grad_clip", "warmup_ratio"):  # no such flags there: its own init, no gradient
            continue  # clipping at all, warmup in steps only (ours is 0 = off)
        expected = None if theirs[flag] == -1 else theirs[flag]  # -1 = auto there
        assert value == expected, flag
    assert "clip_grad" not in (anchor / "scripts" / "base_train.py").read_text() and row["grad_clip"] <= 0
    from nanochat.recipe import RECORD_EVAL_TOKENS
    from scripts import base_train

    assert RECORD_EVAL_TOKENS == theirs["eval_tokens"]
    shared = ("depth", "max_seq_len", "device_batch_size", "num_iterations", "target_flops", "eval_every",
              "core_metric_every", "sample_every", "save_every", "fp8_recipe", "run")
    assert {k: base_train.DEFAULTS[k] for k in shared} == {k: theirs[k] for k in shared}
    assert base_train.CORE_MAX_PER_TASK == theirs["core_metric_max_per_task"]


@pytest.mark.slow  # unpacks and runs 92d63d4's code (its probe: seconds)
@pytest.mark.parametrize("case", range(len(SCALING)))
def test_batch_lr_and_weight_decay_scaling_are_92d63d4s(probe, case):
    depth, ratio, batch, head_dim, seq, vocab, wd, pattern = SCALING[case]
    theirs = probe["scaling"][case]
    config = parse_record_flags(depth=depth, target_param_data_ratio=ratio, head_dim=head_dim, max_seq_len=seq,
                                weight_decay=wd, window_pattern=pattern,
                                **({} if batch == -1 else {"total_batch_size": batch}))
    recipe = resolve_recipe(config)
    out = recipe.batch(config, recipe.model_config(config, vocab))
    scale = theirs["batch_lr_scale"]
    assert out.total_batch_size == theirs["total_batch_size"]
    assert recipe.weight_decay == theirs["weight_decay_scaled"]
    assert out.optimizer_kwargs == dict(unembedding_lr=0.008 * scale, embedding_lr=0.3 * scale, scalar_lr=0.5 * scale,
                                        matrix_lr=0.02 * scale, weight_decay=theirs["weight_decay_scaled"])
    from scripts.base_train import horizon

    with torch.device("meta"):
        model = RecordGPT(recipe.model_config(config, vocab))
    steps = horizon(dict(config, num_iterations=-1, target_flops=-1), recipe.horizon_params(model), 1.0,
                    out.total_batch_size)
    assert steps == max(1, theirs["target_tokens"] // theirs["total_batch_size"])


@pytest.mark.slow  # unpacks and runs 92d63d4's code (its probe: seconds)
@pytest.mark.parametrize("case", range(len(SCHEDULES)))
def test_schedules_are_92d63d4s(probe, case):
    n, warmup, warmdown, final, wd = SCHEDULES[case]
    recipe = resolve_recipe(parse_record_flags(warmup_steps=warmup, warmdown_ratio=warmdown, final_lr_frac=final))
    recipe.weight_decay = wd
    assert [recipe.schedule(step, n) for step in range(n)] == probe["schedules"][case]


def parse_record_flags(**flags):
    from scripts.base_train import FLAGS

    return FLAGS.parse(["--recipe=record", *(f"--{k}={v}" for k, v in flags.items())])


def test_the_recipe_table_fills_only_what_was_left_on_auto():
    from scripts.base_train import FLAGS

    december = resolve_recipe(FLAGS.parse([])).config
    assert {k: december[k] for k in RECIPES["december"]} == RECIPES["december"]
    # the values December's base_train had as plain defaults before --recipe existed
    assert (december["embedding_lr"], december["unembedding_lr"], december["matrix_lr"], december["weight_decay"],
            december["warmdown_ratio"], december["final_lr_frac"], december["grad_clip"], december["total_batch_size"],
            december["target_param_data_ratio"], december["init"]) == (0.2, 0.004, 0.02, 0.0, 0.2, 0.0, 1.0, 524288, 20,
                                                                        "normal")
    record = resolve_recipe(FLAGS.parse(["--recipe=record", "--embedding_lr=0.2", "--warmup_ratio=0.1"])).config
    assert record["embedding_lr"] == 0.2 and record["unembedding_lr"] == 0.008  # explicit wins, the rest the recipe's
    assert record["warmup_ratio"] == 0.1 and record["warmup_steps"] == 0  # a warmup given replaces the recipe's


@pytest.mark.parametrize("argv, message", [
    (["--window_pattern=SSL"], r"--window_pattern is part of the record recipe, not december: .*--recipe=record"),
    (["--scalar_lr=0.1"], r"--scalar_lr is part of the record recipe"),
    (["--recipe=record", "--window_pattern=SXL"], r"--window_pattern must be a non-empty string of S .* and L"),
    (["--recipe=record", "--head_dim=63"], r"--head_dim must be an even number"),
    (["--recipe=record", "--init=normal"], r"--init=normal is not an init of the record model: .*only record"),
    (["--init=record"], r"--init=record is not an init of the december model"),
    (["--recipe=record", "--use_muon=0"], r"--use_muon=0 is december's option"),
    (["--recipe=record", "--warmup_ratio=0.1", "--warmup_steps=5"], r"set one of --warmup_ratio and --warmup_steps"),
])
def test_recipe_mistakes_are_flag_errors(argv, message):
    # parse errors: the launchers' flag check (NANOCHAT_CHECK_FLAGS) stops them before any work too
    from nanochat.configurator import FlagError
    from scripts.base_train import FLAGS

    with pytest.raises(FlagError, match=message):
        FLAGS.parse(argv)


def test_a_recipe_warmdown_overlapping_the_warmup_is_refused_once_filled_in():
    from nanochat.usage import BadValue
    from scripts.base_train import FLAGS

    with pytest.raises(BadValue, match=r"--warmup_ratio \+ --warmdown_ratio must be <= 1: .*\(got 0\.5 \+ 0\.65\)"):
        resolve_recipe(FLAGS.parse(["--recipe=record", "--warmup_ratio=0.5"]))


def test_the_meta_alone_says_which_model():
    december = GPTConfig(sequence_len=64, vocab_size=300, n_layer=2, n_head=2, n_kv_head=2, n_embd=128)
    record = RecordConfig(**vars(december), window_pattern="SL")
    assert type(config_from_dict(vars(december))) is GPTConfig and list(vars(december)) == list(vars(GPTConfig()))
    assert config_from_dict(json.loads(json.dumps(vars(record)))) == record  # what a meta json round trip gives
    assert list(vars(record)) == [*vars(december), "window_pattern"]  # 92d63d4's model_config keys exactly


def test_the_recipe_of_a_meta_without_the_key_is_its_models():
    december = vars(GPTConfig(sequence_len=64, vocab_size=300, n_layer=2, n_head=2, n_kv_head=2, n_embd=128))
    record = dict(december, window_pattern="SL")
    assert checkpoint_recipe({"model_config": record, "recipe": "record"}) == "record"  # what every stage writes now
    # older metas (a base checkpoint of 92d63d4's, a mid/SFT/RL one from before the key): the model says which
    assert checkpoint_recipe({"model_config": record}) == "record"
    assert checkpoint_recipe({"model_config": december}) == checkpoint_recipe({}) == "december"
    assert training_data({"model_config": record}) == ("climbmix", "bestfit")  # base_loss measures it on its data


# -----------------------------------------------------------------------------
# generation with the KV cache == full forwards without it


def decode_model(sequence_len):
    """A record model whose short windows (128) and long window (sequence_len) both bite in a 180-token sequence."""
    model = record_model(attn="sdpa", sequence_len=sequence_len, n_layer=4, n_embd=64, n_head=2, n_kv_head=1)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.mark.parametrize("fixed", [False, True], ids=["eager", "fixed_shape"])
def test_cached_decode_equals_full_forwards_past_the_windows(fixed):
    model = decode_model(sequence_len=64)
    assert model.windows == [128, 128, 128, 64]  # short 128 (> 64: the tile), long 64: generation slides past both
    ids = torch.randint(0, 300, (2, 180), generator=torch.Generator().manual_seed(4))
    prompt = 140
    with torch.inference_mode():
        full = model(ids)  # every position's logits, no cache (the windows as masks over 180 positions)
        cache = KVCache(batch_size=2, num_heads=1, seq_len=256, head_dim=32, num_layers=4)
        logits = [model(ids[:, :prompt], kv_cache=cache)[:, -1]]
        if fixed:
            cache.start_fixed_shape()  # the compiled step's path (run eagerly here): static cache, masks, in-place smear
        for t in range(prompt, ids.size(1) - 1):
            logits.append(model(ids[:, t : t + 1], kv_cache=cache)[:, -1])
            if fixed:
                cache.advance(1)
    torch.testing.assert_close(torch.stack(logits, 1), full[:, prompt - 1 : -1], atol=2e-5, rtol=0)
    # and the windows were not idle: attending everything gives other logits
    with torch.inference_mode():
        model.windows = [None] * 4
        assert (model(ids) - full).abs().max() > 1e-2


def test_chunked_prefill_equals_one_forward():
    # a chunk after a cached prefix: smear reaches across the boundary, the windows cut inside the chunk
    model = decode_model(sequence_len=64)
    ids = torch.randint(0, 300, (1, 170), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        full = model(ids)
        cache = KVCache(batch_size=1, num_heads=1, seq_len=170, head_dim=32, num_layers=4)
        first, second = model(ids[:, :90], kv_cache=cache), model(ids[:, 90:], kv_cache=cache)
    torch.testing.assert_close(torch.cat([first, second], 1), full, atol=2e-5, rtol=0)


class NoToolTokenizer:
    """The Engine's tokenizer interface with special tokens outside the model's vocabulary (300): no row ever stops
    early or calls the tool, so every step is the model's greedy choice."""

    def encode_special(self, s):
        return {"<|assistant_end|>": 1000, "<|python_start|>": 1001, "<|python_end|>": 1002, "<|output_start|>": 1003,
                "<|output_end|>": 1004}[s]

    def get_bos_token_id(self):
        return 1005


def test_engine_greedy_equals_naive_generation():
    model = decode_model(sequence_len=64)
    prompt = torch.randint(0, 300, (150,), generator=torch.Generator().manual_seed(6)).tolist()
    want = list(model.generate(prompt, max_tokens=30, temperature=0))  # full forwards, no cache
    engine = Engine(model, NoToolTokenizer(), decode_compile="0")
    got = [column for column, _ in engine.generate(prompt, num_samples=2, max_tokens=30, temperature=0)]
    assert got == [[t, t] for t in want]


@pytest.mark.slow  # compiles the decode step on CPU
def test_compiled_decode_step_equals_naive_generation():
    model = decode_model(sequence_len=64)
    prompt = torch.randint(0, 300, (150,), generator=torch.Generator().manual_seed(6)).tolist()
    want = list(model.generate(prompt, max_tokens=30, temperature=0))
    engine = Engine(model, NoToolTokenizer(), decode_compile="1")
    for _ in range(2):  # the second reply reuses the static storage (a CUDA graph would be replayed, not recorded)
        got = [column for column, _ in engine.generate(prompt, num_samples=2, max_tokens=30, temperature=0)]
        assert got == [[t, t] for t in want]


def test_activation_checkpointing_gives_the_same_gradients():
    grads = []
    for mode in ("none", "full"):
        model = decode_model(sequence_len=256).train()
        assert model.set_activation_checkpointing(mode) == ([] if mode == "none" else [0, 1, 2, 3])
        ids = torch.randint(0, 300, (2, 256), generator=torch.Generator().manual_seed(7))
        model(ids, ids).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, atol=1e-6, rtol=1e-5, msg=n)


def test_window_sizes_follow_92d63d4s_rule():
    cfg = RecordConfig(sequence_len=2048, vocab_size=10, n_layer=6, n_head=1, n_kv_head=1, n_embd=128)
    assert window_sizes(cfg) == [512, 512, 512, 2048, 512, 2048]  # a quarter of 2048, SSSL tiled, last layer L
    assert window_sizes(RecordConfig(**dict(vars(cfg), sequence_len=1000, window_pattern="SL"))) == \
        [256, 1000, 256, 1000, 256, 1000]  # 250 rounded up to the tile of 128
    assert GPT.rope_base == 10000 and RecordGPT.rope_base == 100000


# -----------------------------------------------------------------------------
# a record-recipe checkpoint from base_train: what it records, who loads it; checkpoints both ways with 92d63d4

TINY_RECORD = ["--recipe=record", "--depth=2", "--head_dim=64", "--max_seq_len=64", "--device_batch_size=4",
               "--total_batch_size=256", "--num_iterations=3", "--warmup_steps=1", "--eval_every=-1",
               "--core_metric_every=-1", "--sample_every=-1", "--device_type=cpu", "--model_tag=rec"]


@pytest.fixture(scope="module")
def record_run(tiny_base_dir, tmp_path_factory):
    """A base dir holding base_checkpoints/rec/ step 3, trained by base_train --recipe=record."""
    from scripts import base_train

    d = tmp_path_factory.mktemp("record") / "base"
    d.mkdir()
    os.symlink(tiny_base_dir / "base_data", d / "base_data")
    os.symlink(tiny_base_dir / "base_data", d / "base_data_climbmix")  # the record recipe reads ClimbMix's directory
    shutil.copytree(tiny_base_dir / "tokenizer", d / "tokenizer")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", str(d))
        base_train.main(TINY_RECORD)
    return d


@pytest.mark.slow
def test_the_recipe_is_in_the_meta_metrics_and_report(record_run):
    from nanochat.metrics import read_metrics

    ckpt = record_run / "base_checkpoints" / "rec"
    meta = json.loads((ckpt / "meta_000003.json").read_text())
    assert meta["recipe"] == "record" and meta["user_config"]["recipe"] == "record"
    assert meta["model_config"] == {"sequence_len": 64, "vocab_size": 512, "n_layer": 2, "n_head": 2, "n_kv_head": 2,
                                    "n_embd": 128, "window_pattern": "SSSL"}  # 92d63d4's keys, nothing else
    assert meta["user_config"]["embedding_lr"] == 0.3 and meta["user_config"]["grad_clip"] == 0.0  # what ran
    assert {"step": 0, "system/recipe": "record"} in read_metrics(ckpt / "metrics.jsonl")
    assert any("Recipe: record" in p.read_text() for p in (record_run / "report").glob("*.md"))


@pytest.mark.slow
def test_checkpoint_manager_builds_the_model_the_meta_names(record_run, monkeypatch):
    from nanochat.checkpoint_manager import load_model
    from nanochat.usage import BadValue

    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(record_run))
    model, tok, meta = load_model("base", "cpu", "eval")
    assert type(model) is RecordGPT and model.config == config_from_dict(meta["model_config"])
    state = torch.load(record_run / "base_checkpoints" / "rec" / "model_000003.pt", weights_only=True)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    # the same weights under a December model_config (a meta from another run): refused, naming what differs
    ckpt = record_run / "base_checkpoints" / "wrong"
    shutil.copytree(record_run / "base_checkpoints" / "rec", ckpt)
    try:
        meta["model_config"].pop("window_pattern")
        (ckpt / "meta_000003.json").write_text(json.dumps(meta))
        with pytest.raises(BadValue, match=r"the weights are a record-recipe model, the model_config a december-recipe "
                                           r"one; 7 unexpected tensor\(s\) .* copy both from the same run"):
            load_model("base", "cpu", "eval", model_tag="wrong")
    finally:
        shutil.rmtree(ckpt)  # the other tests load this base dir's one model tag


@pytest.mark.slow
def test_resuming_under_the_other_recipe_is_refused(record_run, monkeypatch):
    from nanochat.usage import BadValue
    from scripts import base_train

    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(record_run))
    december = [a for a in TINY_RECORD if not a.startswith(("--recipe", "--head_dim", "--warmup_steps"))]
    with pytest.raises(BadValue, match=r"holds a model with .*window_pattern=SSSL but this run builds .*window_pattern="
                                       r"None: resume with the model flags of the run that saved it \(--recipe=record "
                                       r"--depth=2\)"):
        base_train.main([*december, "--num_iterations=5", "--resume_from_step=3"])


@pytest.mark.slow
def test_chat_cli_runs_a_record_checkpoint_from_its_meta(record_run, monkeypatch):
    from nanochat.checkpoint_manager import load_model

    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(record_run))
    model, tok, _ = load_model("base", "cpu", "eval", model_tag="rec")
    special = tok.encode_special
    prompt = [tok.get_bos_token_id(), special("<|user_start|>"), *tok.encode("Hello there"), special("<|user_end|>"),
              special("<|assistant_start|>")]
    reply = []
    for t in model.generate(prompt, max_tokens=12, temperature=0):  # full forwards, no cache
        if t in (special("<|assistant_end|>"), tok.get_bos_token_id()):
            break
        reply.append(t)
    cmd = [sys.executable, "-m", "scripts.chat_cli", "-i", "base", "-g", "rec", "-t", "0", "-m", "12", "--device_type", "cpu",
           "-p", "Hello there"]
    p = subprocess.run(cmd, env=subprocess_env(record_run), capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr
    assert reply and p.stdout == tok.decode(reply) + "\n"


@pytest.mark.slow
def test_export_hf_refuses_the_record_model_in_one_line(record_run, tmp_path):
    cmd = [sys.executable, "-m", "scripts.export_hf", "-i", "base", "-g", "rec", "--out", str(tmp_path / "hf")]
    p = subprocess.run(cmd, env=subprocess_env(record_run), capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("error: transformers' NanoChat model has no sliding-window "
                                                         "attention, value embeddings, smear, backout")
    assert not (tmp_path / "hf").exists()


def ours_on_prompts(base_dir, model_tag, max_tokens, monkeypatch):
    """(logits per prompt, greedy tokens per prompt from the Engine) of a base checkpoint loaded here."""
    from nanochat.checkpoint_manager import load_model

    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base_dir))
    model, tok, _ = load_model("base", "cpu", "eval", model_tag=model_tag)
    assert type(model) is RecordGPT
    engine = Engine(model, tok)
    logits, tokens = [], []
    for prompt in PROMPTS:
        ids = tok(prompt, prepend="<|bos|>")
        with torch.no_grad():
            logits.append(model(torch.tensor([ids])))
        out, _ = engine.generate_batch(ids, num_samples=1, max_tokens=max_tokens, temperature=0)
        tokens.append(out[0][len(ids):])
    return logits, tokens


def assert_same_on_prompts(ours, theirs):
    logits, tokens = ours
    assert len(logits) == len(theirs["logits"]) == len(PROMPTS)
    for a, b in zip(logits, theirs["logits"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert tokens == theirs["tokens"] and any(tokens)


@pytest.mark.slow
def test_a_92d63d4_checkpoint_loads_here(anchor, tiny_base_dir, tmp_path, monkeypatch):
    base = tmp_path / "base"  # 92d63d4 reads base_data_climbmix/; the project's tokenizer loads there unchanged
    base.mkdir()
    os.symlink(tiny_base_dir / "base_data", base / "base_data_climbmix")
    shutil.copytree(tiny_base_dir / "tokenizer", base / "tokenizer")
    run_anchor(anchor, ["-m", "scripts.base_train", "--device-type=cpu", "--depth=2", "--head-dim=64",
                        "--max-seq-len=64", "--device-batch-size=4", "--total-batch-size=256", "--num-iterations=2",
                        "--warmup-steps=1", "--eval-every=-1", "--core-metric-every=-1", "--sample-every=-1",
                        "--model-tag=theirs"], base_dir=base)
    run_anchor(anchor, [SCRIPTS / "generate_92d63d4.py", anchor, "theirs", 16, tmp_path / "theirs.pt", *PROMPTS],
               base_dir=base)
    theirs = torch.load(tmp_path / "theirs.pt", weights_only=False)
    assert_same_on_prompts(ours_on_prompts(base, "theirs", 16, monkeypatch), theirs)


@pytest.mark.slow
def test_our_record_checkpoint_loads_in_92d63d4(anchor, record_run, tmp_path, monkeypatch):
    run_anchor(anchor, [SCRIPTS / "generate_92d63d4.py", anchor, "rec", 16, tmp_path / "theirs.pt", *PROMPTS],
               base_dir=record_run)
    theirs = torch.load(tmp_path / "theirs.pt", weights_only=False)
    assert_same_on_prompts(ours_on_prompts(record_run, "rec", 16, monkeypatch), theirs)


@pytest.mark.slow
def test_mid_sft_rl_chain_on_a_record_model(chat_env):  # noqa: F811 (the fixture imported above)
    """Each post-training stage loads the previous stage's record model from its meta alone, trains it, and records
    the recipe in its own meta and report section."""
    from nanochat.checkpoint_manager import load_model, save_checkpoint
    from nanochat.gpt import record_config_for_depth
    from nanochat.tokenizer import get_tokenizer
    from nanochat.training import init_model as build_model
    from scripts import chat_rl, chat_sft, mid_train

    # beside chat_env's December d1: the stages take the largest tag, this d2
    config = record_config_for_depth(2, get_tokenizer().get_vocab_size(), 128, head_dim=64, window_pattern="SL")
    model = build_model(config, "cpu", init="record")
    save_checkpoint(str(chat_env / "base_checkpoints" / "d2"), 0, model.state_dict(), None,
                    {"model_config": vars(config), "recipe": "record", "step": 0})

    mid_train.main(["--device_type=cpu", "--max_seq_len=64", "--device_batch_size=2", "--total_batch_size=256",
                    "--num_iterations=2", "--eval_every=-1"])
    chat_sft.main(["--device_type=cpu", "--device_batch_size=2", "--target_examples_per_step=4", "--num_iterations=2",
                   "--eval_every=-1", "--eval_metrics_every=-1"])
    chat_rl.main(["--device_type=cpu", "--num_samples=2", "--device_batch_size=2", "--examples_per_step=2",
                  "--max_new_tokens=8", "--num_iterations=1", "--eval_every=-1", "--save_every=-1"])
    previous = model.state_dict()
    for stage in ("mid", "sft", "rl"):
        loaded, _, meta = load_model(stage, "cpu", "eval")
        assert type(loaded) is RecordGPT and meta["model_config"] == vars(config), stage
        assert meta["recipe"] == "record", stage
        state = loaded.state_dict()
        assert any(not torch.equal(state[k], previous[k]) for k in state), f"{stage} did not train the record model"
        previous = state
    for section in ("midtraining.md", "chat-sft.md", "chat-rl.md"):
        assert "- Recipe: record" in (chat_env / "report" / section).read_text(), section


@pytest.mark.slow
def test_record_recipe_resume_is_bit_exact_with_deterministic(base_dir):
    """N steps + resume + N steps == 2N steps with the record recipe (its schedules, groups and scalars restored)."""
    from test_resume import assert_same_weights, base_train, copy_step, final_weights, losses

    os.symlink(base_dir / "base_data", base_dir / "base_data_climbmix")  # the record recipe reads ClimbMix's directory
    n, record = 3, ["--recipe=record", "--head_dim=64", "--warmup_steps=2", "--deterministic=1"]
    base_train(base_dir, *record, f"--num_iterations={2 * n}", f"--save_every={n}", "--model_tag=full")
    copy_step(base_dir, "full", "resumed", n)
    base_train(base_dir, *record, f"--num_iterations={2 * n}", "--model_tag=resumed", "--resume_from_step=auto")
    full, resumed = losses(base_dir, "full"), losses(base_dir, "resumed")
    assert [resumed[s] for s in range(n + 1, 2 * n + 1)] == [full[s] for s in range(n + 1, 2 * n + 1)]
    assert_same_weights(final_weights(base_dir, "full", 2 * n), final_weights(base_dir, "resumed", 2 * n))
