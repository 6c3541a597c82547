"""
The launchers' entry point: pretrain.sh, speedrun.sh (and run1000.sh through it) and runcpu.sh each exec

    python -m scripts.launch run LAUNCHER ARGS...    run that launcher: its pipeline, setup included
    python3 -m scripts.launch LAUNCHER ARGS...       only check its flags and settings: prints DRY_RUN=0|1
    python3 -m scripts.launch suggest NAME KNOWN...  " Did you mean: --x?" for volc/volc_submit.sh's unknown options

Each launcher's flags are nanochat's Flags, so a launcher refuses a mistake the way every script does: one line naming
the flag, "Did you mean", exit status 2, nothing run. One function per launcher below reads its flags and its
environment into Settings and checks them, before anything runs; nanochat/launch/pipeline.py builds the steps from
them (one builder, a profile per launcher) and nanochat/launch/runner.py runs them, with the stop signals passed on
to the running stage.

Only the standard library and nanochat's standard-library modules (configurator, presets, setup_check, usage, launch/)
are imported: speedrun.sh and runcpu.sh run this with the system's python3 before anything is installed.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys

from nanochat import presets
from nanochat.configurator import Flag, FlagError, Flags, Rule, suggest
from nanochat.launch.nodes import Node, discover, gpu_compute_capability, whole
from nanochat.launch.pipeline import (DEFAULT_RECIPE, FP8_CAPABILITY, RECIPES, RECORD_SPEEDRUN, Settings, build)
from nanochat.launch.runner import run_pipeline
from nanochat.setup_check import quick_install_problem, wandb_problem
from nanochat.usage import BadValue, CannotRun, run_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Seconds torchrun gives the ranks after a signal before it kills them (its default is 30): one step plus a checkpoint
# write. Given as TORCH_ELASTIC_SHUTDOWN_TIMEOUT, not --shutdown-timeout: torch >= 2.9 takes the signal list, but
# only later versions the flag, and those read the variable too (older ones keep 30 s). A value already set wins.
SHUTDOWN_TIMEOUT = 300
# Some platforms (Kubeflow-style PyTorchDDP jobs) export these per node. torchrun sets the per-process values for its
# children; the launcher (whose errors nanochat.usage prints on rank 0 only) and the plain python steps (download,
# tokenizer, report) must not see the node's.
NODE_RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def header(launcher):
    """The launcher's header comment (line 2 down to `set -euo pipefail`): its --help text."""
    lines = []
    with open(os.path.join(REPO, launcher), encoding="utf-8") as f:
        for i, line in enumerate(f):
            if line.startswith("set -euo pipefail"):
                break
            if i > 0:
                lines.append(line.rstrip("\n")[2:] if line.startswith("# ") else line.rstrip("\n").lstrip("#"))
    return "\n".join(lines)


def interpreter(env):
    """(python, torchrun) argv prefixes: $PYTHON and $TORCHRUN, else python (python3) and torchrun (python -m
    torch.distributed.run)."""
    py = shlex.split(env.get("PYTHON") or ("python" if shutil.which("python") else "python3"))
    if env.get("TORCHRUN"):
        tr = shlex.split(env["TORCHRUN"])
    else:
        tr = ["torchrun"] if shutil.which("torchrun") else [*py, "-m", "torch.distributed.run"]
    return py, tr


def resolve_preset(depth, train_args=(), **settings):
    try:
        return presets.resolve_launch(depth, train_args, **settings)
    except ValueError as e:
        raise BadValue(str(e)) from None


def base_dir(env):
    return env.get("NANOCHAT_BASE_DIR") or os.path.expanduser("~/.cache/nanochat")


# -----------------------------------------------------------------------------
# the launchers' flags


def dry_run_flag(env, what):
    value = env.get("NANOCHAT_DRY_RUN", "0").strip().lower()
    if value not in ("", "0", "1", "true", "false", "yes", "no", "on", "off"):
        raise BadValue(f"NANOCHAT_DRY_RUN expects 0 or 1, got '{value}'")
    return Flag("dry_run", value not in ("", "0", "false", "no", "off"), what)


def recipe_flag():
    return Flag("recipe", DEFAULT_RECIPE, "training recipe, passed to base_train as --recipe when not december: "
                "december (nanochat's December 2025 model and optimizer) or record (nanochat's record run)",
                choices=list(RECIPES))


def env_int(env, name, default):
    text = env.get(name) or str(default)
    if not re.fullmatch(r"-?\d+", text):
        raise BadValue(f"{name} must be a whole number, got '{text}'")
    return int(text)


def resume_flags(env):
    return [Flag("save_every", env_int(env, "SAVE_EVERY", 500), "every training stage saves a checkpoint every N steps "
                 "(-1: the final one only; env SAVE_EVERY) and starts from its latest complete one", min=-1),
            Flag("max_restarts", env_int(env, "MAX_RESTARTS", 3), "torchrun restarts a crashed training stage up to N "
                 "times (env MAX_RESTARTS)", min=0)]


def pretrain_flags(env):
    return Flags(
        Flag("depth", int(env.get("MODEL_DEPTH") or 20), "preset depth (table: python -m nanochat.presets --format "
             "markdown); another depth with both --num_shards and --device_batch_size", min=1),
        Flag("posttrain", False, "mid_train -> chat_eval -i mid -> chat_sft -> chat_eval -i sft (no data, no base)"),
        Flag("fullrun", False, "pretrain and posttrain"),
        Rule(("posttrain", "fullrun"), lambda post, full: not (post and full),
             "--posttrain and --fullrun are two different modes: pass one (--fullrun already runs the post-training) "
             "(got --posttrain={posttrain:d} --fullrun={fullrun:d})"),
        Flag("num_shards", None, "data shards to download (the preset's by default)", type=int, min=0),
        Flag("device_batch_size", None, "per-GPU batch (the preset's by default)", type=int, min=0),
        Flag("use_fsdp", None, "FSDP2 instead of DDP (on by default from d40)", type=bool),
        Flag("activation_checkpointing", None, "recompute block activations in the backward (preset: none)", type=str,
             choices=list(presets.AC_MODES)),
        Flag("ac_every", None, "with --activation_checkpointing=selective: every K-th block", type=int, min=1),
        Flag("tp_size", None, "tensor parallelism over N GPUs of a node (preset: 1)", type=int, min=1),
        Flag("model_tag", "", "checkpoint tag passed to every stage (default: base_train's d{depth})"),
        Flag("run", env.get("WANDB_RUN") or "dummy", "wandb run name (dummy = wandb off)"),
        Flag("nproc_per_node", None, "processes per node (or NPROC_PER_NODE; default: visible GPUs, "
             "SLURM_GPUS_ON_NODE, MLP_WORKER_GPU, 1 on CPU)", type=int, min=1),
        Flag("prepare", True, "download the data and train the tokenizer first (0: already in place)"),
        recipe_flag(),
        *resume_flags(env),
        dry_run_flag(env, "print the resolved settings and the commands, run nothing"),
        prog="bash pretrain.sh", description=header("pretrain.sh"))


def speedrun_flags(env):
    return Flags(dry_run_flag(env, "print every command, setup included, and run none"), recipe_flag(),
                 *resume_flags(env), prog="bash speedrun.sh", description=header("speedrun.sh"))


def runcpu_flags(env):
    return Flags(dry_run_flag(env, "print every command, setup included (venv, Rust, install), and run none"),
                 recipe_flag(), prog="bash runcpu.sh", description=header("runcpu.sh"))


def split_args(argv, flags):
    """pretrain.sh's arguments as --name=value: (its own, base_train's). A switch may stand alone."""
    own, rest, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--") or arg == "--":
            raise FlagError(f"unexpected argument '{arg}': flags look like --name=value or --name value (see --help)")
        name, eq, value = arg[2:].partition("=")
        name = name.replace("-", "_")
        if not eq:
            nxt = argv[i] if i < len(argv) else None
            if name in flags and flags[name].type is bool:  # `--dry_run` alone is on; `--dry_run 0` reads the value
                bool_word = nxt is not None and nxt.lower() in ("0", "1", "true", "false", "yes", "no", "on", "off")
                value, i = (nxt, i + 1) if bool_word else ("1", i)
            elif nxt is None or nxt.startswith("--"):
                if name in flags:
                    raise FlagError(f"flag --{name} needs a value (--{name}=VALUE)")
                rest.append(f"--{name}")  # base_train says what it is: a switch of its own, or a mistake
                continue
            else:
                value, i = nxt, i + 1
        (own if name in flags else rest).append(f"--{name}={value}")
    return own, rest


def check_installed(py):
    """pretrain.sh runs on an interpreter that has nanochat installed (it installs nothing itself: on a cluster every
    node would install at once), else one line saying how to install it. This process is that interpreter
    (pretrain.sh execs $PYTHON, python or python3 on this file, as interpreter() picks it for the stages)."""
    problem = quick_install_problem()
    if problem:
        venv = os.path.join(REPO, ".venv", "bin", "python")
        other = " (PYTHON=.venv/bin/python: the venv runcpu.sh and speedrun.sh set up)" if os.path.exists(venv) else ""
        raise CannotRun(f"{shlex.join(py)} cannot run nanochat: {problem}. Install it into that interpreter with "
                        f"`{shlex.join(py)} -m pip install -e .` from {REPO} (it builds the rustbpe tokenizer: needs "
                        f"Rust, https://rustup.rs), or set PYTHON to an interpreter that has it{other}")


def check_wandb(run_name, name="--run="):
    """A wandb run name needs a wandb login: said before any download (base_train would say it after them)."""
    problem = wandb_problem(run_name)
    if problem:
        raise CannotRun(problem.replace("--run=", name))


def check_base_train_flags(py, own, rest, flags, env):
    """A flag pretrain.sh does not know goes on to base_train: base_train checks them all first (NANOCHAT_CHECK_FLAGS:
    parse, then exit), with pretrain.sh's own names accepted and suggested, so a misspelling or a value out of range
    stops here, before any download or torchrun."""
    kinds = {bool: "bool", int: "int", float: "float", str: "str"}
    check = " ".join(f"{f.name}:{kinds[f.type]}" for f in flags.flags())
    env = {**env, "NANOCHAT_CHECK_FLAGS": check, "PYTHONPATH": REPO + os.pathsep + env.get("PYTHONPATH", "")}
    if subprocess.run([*py, "-m", "scripts.base_train", *own, *rest], env=env, cwd=REPO, stdout=subprocess.DEVNULL).returncode:
        sys.exit(2)


# -----------------------------------------------------------------------------
# each launcher's settings: its flags and its environment, read and checked here, before anything runs


def pretrain_settings(argv, env):
    """pretrain.sh: its flags (and base_train's, checked by base_train), where this node runs, the depth preset, and
    NANOCHAT_BASE_DIR, NANOCHAT_SHARED_FS, NANOCHAT_PREP_TIMEOUT/_POLL, TORCH_ELASTIC_SHUTDOWN_TIMEOUT, TOK_MAX_CHARS."""
    env, flags = dict(env), pretrain_flags(env)  # env: the commands' environment
    if "-h" in argv or "--help" in argv:
        flags.parse(["--help"])
    py, tr = interpreter(env)
    check_installed(py)
    own, rest = split_args(argv, flags)
    if rest:
        check_base_train_flags(py, own, rest, flags, env)
    cfg = flags.parse(own)
    check_wandb(cfg.run)
    mode = "fullrun" if cfg.fullrun else "posttrain" if cfg.posttrain else "pretrain"
    node = discover(env, cfg.nproc_per_node or env.get("NPROC_PER_NODE") or None)
    prep_timeout = whole("NANOCHAT_PREP_TIMEOUT", env.get("NANOCHAT_PREP_TIMEOUT", "14400"))
    launch = resolve_preset(
        cfg.depth, rest + ([f"--ac_every={cfg.ac_every}"] if cfg.ac_every else []), num_shards=cfg.num_shards,
        device_batch_size=cfg.device_batch_size, use_fsdp=cfg.use_fsdp, world_size=node.nnodes * node.nproc,
        mode=mode, activation_checkpointing=cfg.activation_checkpointing, tp_size=cfg.tp_size)
    env["NANOCHAT_BASE_DIR"] = base = base_dir(env)
    shared = env.get("NANOCHAT_SHARED_FS", "1")
    if shared.lower() not in ("0", "1", "true", "false", "yes", "no", "on", "off"):
        raise BadValue(f"NANOCHAT_SHARED_FS expects 0 or 1, got '{shared}'")
    shutdown = whole("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", SHUTDOWN_TIMEOUT))
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT))
    s = Settings("pretrain", "pretrain.sh", env, base, py, tr, cfg.dry_run, mode, node, launch,
                 device="cuda" if node.ngpu else "", recipe=cfg.recipe, base_args=rest, run_name=cfg.run,
                 model_tag=cfg.model_tag, ac_every=cfg.ac_every, save_every=cfg.save_every,
                 max_restarts=cfg.max_restarts, prepare=cfg.prepare, shared_fs=shared.lower() in ("1", "true", "yes", "on"),
                 prep_timeout=prep_timeout, prep_poll=float(env.get("NANOCHAT_PREP_POLL", "10")),
                 tok_max_chars=env.get("TOK_MAX_CHARS", "2000000000"))
    resolved = dict(
        launcher=node.launcher, nnodes=node.nnodes, node_rank=node.node_rank,
        nproc_per_node=f"{node.nproc} ({node.nproc_src})", world_size=node.nnodes * node.nproc,
        master_addr=node.master_addr or "(standalone)", master_port=node.master_port or "(standalone)",
        hosts=" ".join(node.hosts) or None, mode=mode, depth=launch.depth, num_shards=launch.num_shards,
        device_batch_size=launch.device_batch_size, grad_accum=launch.grad_accum, use_fsdp=int(launch.use_fsdp),
        activation_checkpointing=launch.activation_checkpointing + (f" (ac_every={cfg.ac_every})" if cfg.ac_every else ""),
        tp_size=launch.tp_size, est_gb_per_gpu=f"{launch.est_gb} (upper bound; nanochat.presets)",
        device_type="cuda" if node.ngpu else "auto", model_tag=cfg.model_tag or f"(default: d{launch.depth})",
        run=cfg.run, recipe=cfg.recipe, base_dir=base, shared_fs=shared, prepare=int(cfg.prepare),
        save_every=cfg.save_every, max_restarts=cfg.max_restarts, shutdown_timeout=shutdown)
    s.summary = ["[pretrain.sh] resolved settings:", *(f"{k}={v}" for k, v in resolved.items() if v is not None),
                 *(f"[pretrain.sh] note: {note}" for note in launch.notes)]
    if node.nnodes > 1 and not s.shared_fs:
        s.summary.append("[pretrain.sh] note: NANOCHAT_SHARED_FS=0: a restarted or requeued training stage resumes "
                         "only if every node reads the same checkpoint directory; with node-local base dirs it starts fresh")
    return s


def speedrun_settings(argv, env):
    """speedrun.sh (run1000.sh): its flags, and NPROC, DEPTH, NUM_SHARDS, DEVICE_BATCH, WANDB_RUN, NANOCHAT_VENV,
    NANOCHAT_BASE_DIR. --recipe=record is nanochat's record run (pipeline.RECORD_SPEEDRUN says what it sets)."""
    cfg = speedrun_flags(env).parse(argv)
    check_wandb(env.get("WANDB_RUN") or "dummy", "WANDB_RUN=")
    record = RECORD_SPEEDRUN if cfg.recipe == "record" else {}
    nproc = whole("NPROC", env.get("NPROC") or "8", 1)
    depth = whole("DEPTH", env.get("DEPTH") or str(record.get("depth", 20)), 1)
    own_shape = record if depth == record.get("depth") else {}  # the record run's shape, at its depth only
    given = lambda var, key: whole(var, env[var], 0) if env.get(var) else own_shape.get(key)
    launch = resolve_preset(depth, num_shards=given("NUM_SHARDS", "num_shards"),
                            device_batch_size=given("DEVICE_BATCH", "device_batch_size"), world_size=nproc, mode="fullrun")
    base_args = list(record.get("base_args", []))
    fp8 = bool(record) and (gpu_compute_capability(env) or (0, 0)) >= FP8_CAPABILITY
    base_args += ["--fp8=1"] if fp8 else []
    venv, base = env.get("NANOCHAT_VENV") or ".venv", base_dir(env)
    cmd_env = {**env, "OMP_NUM_THREADS": "1", "NANOCHAT_BASE_DIR": base}
    cmd_env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT))
    s = Settings("speedrun", "speedrun.sh", cmd_env, base, [f"{venv}/bin/python"], [f"{venv}/bin/torchrun"],
                 cfg.dry_run, "fullrun", Node("single", nproc=nproc, ngpu=nproc), launch, device="cuda", venv=venv,
                 recipe=cfg.recipe, base_args=base_args, run_name=env.get("WANDB_RUN") or "dummy",
                 save_every=cfg.save_every, max_restarts=cfg.max_restarts)
    s.summary = [f"[speedrun.sh] note: {note}" for note in launch.notes]
    s.summary.append(f"[speedrun.sh] d{depth} on {nproc} GPUs: {launch.num_shards} shards, device batch "
                     f"{launch.device_batch_size}, grad accumulation {launch.grad_accum}, FSDP {int(launch.use_fsdp)}"
                     + (f"; recipe {cfg.recipe}, FP8 {int(fp8)}" if record else ""))
    return s


def runcpu_settings(argv, env):
    """runcpu.sh: its flags, and NANOCHAT_VENV, NANOCHAT_BASE_DIR, NANOCHAT_DATA_DIR (default ../shared/data beside
    the repo, when there), RUNCPU_BASE_STEPS, OMP_NUM_THREADS (default: the CPUs this process may use)."""
    cfg = runcpu_flags(env).parse(argv)
    venv, base = env.get("NANOCHAT_VENV") or ".venv", base_dir(env)
    shared_data = os.path.join(os.path.dirname(REPO), "shared", "data")
    data_dir = env.get("NANOCHAT_DATA_DIR") or (shared_data if os.path.isdir(shared_data) else "")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
    cmd_env = {**env, "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS") or str(cpus), "NANOCHAT_BASE_DIR": base}
    if data_dir:
        cmd_env["NANOCHAT_DATA_DIR"] = data_dir
    return Settings("runcpu", "runcpu.sh", cmd_env, base, [f"{venv}/bin/python"], dry_run=cfg.dry_run, device="cpu",
                    venv=venv, recipe=cfg.recipe, base_steps=str(whole("RUNCPU_BASE_STEPS", env.get("RUNCPU_BASE_STEPS") or "500", 1)), data_dir=data_dir)


LAUNCHERS = {"pretrain.sh": pretrain_settings, "speedrun.sh": speedrun_settings, "runcpu.sh": runcpu_settings}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["suggest"] and argv[1:]:
        print(suggest(argv[1], argv[2:]), end="")
        return 0
    run = argv[:1] == ["run"]
    argv = argv[1:] if run else argv
    if not argv or argv[0] not in LAUNCHERS:  # --help, or a mistake: the launcher comes first
        Flags(Flag("launcher", None, "the launcher whose flags follow", type=str, choices=list(LAUNCHERS),
                   positional=True, required=True),
              dry_run_flag(os.environ, "every launcher's: print what it would run, run nothing (its --help says what "
                           "exactly)"),
              prog="python3 -m scripts.launch [run]", description=__doc__).parse(argv)
        raise FlagError(f"flags go after the launcher's name: python3 -m scripts.launch [run] LAUNCHER FLAGS ({argv})")
    for name in NODE_RANK_VARS:
        os.environ.pop(name, None)
    settings = LAUNCHERS[argv[0]](argv[1:], dict(os.environ))  # --help prints the help and exits 0
    if not run:
        print(f"DRY_RUN={int(settings.dry_run)}")
        return 0
    for line in settings.summary:
        print(line, flush=True)
    return run_pipeline(build(settings), settings.dry_run)


if __name__ == "__main__":
    run_main(main)
