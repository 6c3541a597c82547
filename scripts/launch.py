"""
The launchers' logic, in Python: flags (nanochat's Flags, so a launcher refuses a mistake the way every script does:
one line naming the flag, "Did you mean", exit status 2, nothing run), where this node runs (plain torchrun,
Volcengine, Slurm), the depth preset (nanochat/presets.py), the stage pipeline (declared once, in `stages` below)
and running it, with the stop signals passed on to the running stage.

    python3 -m scripts.launch runcpu.sh ARGS...         check runcpu.sh's flags: prints DRY_RUN=0|1 for it to eval
    python3 -m scripts.launch speedrun.sh ARGS...       the same for speedrun.sh (run before its venv exists)
    python -m scripts.launch run speedrun.sh ARGS...    speedrun.sh's pipeline, after its setup
    python -m scripts.launch run pretrain.sh ARGS...    all of pretrain.sh

Only the standard library and nanochat's standard-library modules (configurator, presets, setup_check, usage) are
imported: the first two forms run on a fresh machine before anything is installed.
"""

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from nanochat import presets
from nanochat.configurator import Flag, FlagError, Flags, Rule
from nanochat.setup_check import quick_install_problem, wandb_problem
from nanochat.usage import BadValue, CannotRun, run_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINING = ("scripts.base_train", "scripts.mid_train", "scripts.chat_sft", "scripts.chat_rl")
# torchrun passes these on to the ranks; without SIGUSR1 in the list (Slurm's --signal) the signal kills torchrun
STOP_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
# Seconds torchrun gives the ranks after a signal before it kills them (its default is 30): one step plus a checkpoint
# write. Given as TORCH_ELASTIC_SHUTDOWN_TIMEOUT, not --shutdown-timeout: torch >= 2.9 takes the signal list, but
# only later versions the flag, and those read the variable too (older ones keep 30 s). A value already set wins.
SHUTDOWN_TIMEOUT = 300
FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)


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


def log(launcher, message):
    print(f"[{launcher}] {message}", flush=True)


# -----------------------------------------------------------------------------
# Slurm host lists: "gpu[01-04,07],cpu3" -> gpu01 gpu02 gpu03 gpu04 gpu07 cpu3 (scontrol is only on Slurm nodes)


def expand_hostlist(text):
    """The hosts of a Slurm node list, in order. Zero padding follows the lower bound, as Slurm writes it."""
    items, depth, item = [], 0, ""
    for ch in text:  # split at the commas outside brackets
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            items.append(item)
            item = ""
        else:
            item += ch
    items.append(item)
    return [host for item in items if item for host in _expand_item(item)]


def _expand_item(item):
    m = re.fullmatch(r"([^\[\]]*)\[([^\[\]]*)\](.*)", item)
    if m is None:
        if "[" in item or "]" in item:
            raise BadValue(f"unbalanced brackets in Slurm node list item '{item}'")
        return [item]
    prefix, ranges, suffix = m.groups()
    if not ranges:
        raise BadValue(f"empty brackets in Slurm node list item '{item}'")
    hosts = []
    for part in ranges.split(","):
        r = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if r is None:
            raise BadValue(f"cannot read '{part}' in Slurm node list item '{item}' (expected N or N-M)")
        lo, hi = r.group(1), r.group(2) or r.group(1)
        if int(lo) > int(hi):
            raise BadValue(f"descending range '{part}' in Slurm node list item '{item}'")
        for n in range(int(lo), int(hi) + 1):
            hosts += _expand_item(f"{prefix}{n:0{len(lo)}d}{suffix}")  # the suffix may hold more brackets
    return hosts


def resolve_hosts(nodelist):
    """Slurm's own answer (scontrol) where there is one, else expand_hostlist."""
    if shutil.which("scontrol"):
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
        return out.stdout.split()
    return expand_hostlist(nodelist)


# -----------------------------------------------------------------------------
# where this node runs


@dataclass
class Node:
    launcher: str  # volcengine | slurm | torchrun | single
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = ""
    master_port: int = 0
    nproc: int = 1
    nproc_src: str = ""
    ngpu: int = 0
    hosts: list = field(default_factory=list)
    job_key: str = ""  # names the preparation marker and torchrun's rendezvous: the same on every node of a job


def _whole(name, text, minimum=0):
    if not re.fullmatch(r"\d+", str(text or "")) or int(text) < minimum:
        raise BadValue(f"{name} must be a whole number >= {minimum}, got '{text or ''}'")
    return int(text)


def count_visible_gpus(env):
    if "CUDA_VISIBLE_DEVICES" in env:  # set but empty (or -1) hides every GPU from CUDA
        ids = env["CUDA_VISIBLE_DEVICES"]
        return 0 if not ids or ids.startswith("-") else len(ids.split(","))
    if shutil.which("nvidia-smi", path=env.get("PATH")):
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, env=env)
        return sum(line.startswith("GPU ") for line in out.stdout.splitlines()) if out.returncode == 0 else 0
    return 0


def discover(env, nproc=None):
    """
    The node's place in the job, from the environment (first match wins; NANOCHAT_LAUNCHER forces one):
      volcengine  MLP_WORKER_NUM, MLP_ROLE_INDEX, MLP_WORKER_0_HOST/PORT, MLP_WORKER_GPU, MLP_TASK_ID
      slurm       SLURM_NNODES, SLURM_NODEID, the first host of the step's (or job's) node list, MASTER_PORT or
                  20000 + SLURM_JOB_ID % 10000, SLURM_GPUS_ON_NODE, SLURM_JOB_ID
      torchrun    NNODES > 1, NODE_RANK, MASTER_ADDR, MASTER_PORT (29500)
      single      one node: one process per visible GPU, 1 on CPU
    """
    launcher = env.get("NANOCHAT_LAUNCHER", "auto") or "auto"
    slurm_nodes = env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES")
    if launcher == "auto":
        launcher = ("volcengine" if env.get("MLP_WORKER_NUM") else "slurm" if slurm_nodes else
                    "torchrun" if (env.get("NNODES") or "").isdigit() and int(env["NNODES"]) > 1 else "single")
    node, src = Node(launcher), ""
    if launcher == "volcengine":
        node.nnodes = _whole("MLP_WORKER_NUM", env.get("MLP_WORKER_NUM"), 1)
        if node.nnodes > 1:
            for var in ("MLP_WORKER_0_HOST", "MLP_WORKER_0_PORT"):
                if not env.get(var):
                    raise BadValue(f"{var} is not set: the Volcengine platform sets it for multi-node tasks "
                                   f"(Framework PyTorchDDP)")
            node.node_rank, node.master_addr = env.get("MLP_ROLE_INDEX", ""), env["MLP_WORKER_0_HOST"]
            node.master_port = env["MLP_WORKER_0_PORT"]
        if nproc is None and env.get("MLP_WORKER_GPU"):
            nproc, src = env["MLP_WORKER_GPU"], "MLP_WORKER_GPU"
        node.job_key = env.get("MLP_TASK_ID", "")
    elif launcher == "slurm":
        node.nnodes = _whole("SLURM_NNODES", slurm_nodes, 1)
        tasks, step_nodes = env.get("SLURM_STEP_NUM_TASKS"), env.get("SLURM_STEP_NUM_NODES")
        if tasks and step_nodes and int(tasks) > int(step_nodes):
            raise BadValue(f"this srun step starts {tasks} tasks on {step_nodes} nodes; pretrain.sh must run once per "
                           f"node (srun --ntasks-per-node=1): torchrun starts the per-GPU processes")
        if node.nnodes > 1:
            nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
            if not nodelist:
                raise BadValue("SLURM_JOB_NODELIST is not set: cannot find the master node")
            node.hosts = resolve_hosts(nodelist)
            if len(node.hosts) != node.nnodes:
                raise BadValue(f"Slurm node list '{nodelist}' has {len(node.hosts)} hosts but SLURM_NNODES={node.nnodes}")
            node.node_rank, node.master_addr = env.get("SLURM_NODEID", ""), node.hosts[0]
            job = env.get("SLURM_JOB_ID", "")
            # a per-job port: two jobs that share a first node do not collide
            node.master_port = env.get("MASTER_PORT") or (20000 + int(job) % 10000 if job.isdigit() else 29500)
        if nproc is None and env.get("SLURM_GPUS_ON_NODE"):
            nproc, src = env["SLURM_GPUS_ON_NODE"], "SLURM_GPUS_ON_NODE"
        node.job_key = env.get("SLURM_JOB_ID", "")
    elif launcher == "torchrun":
        node.nnodes = _whole("NNODES", env.get("NNODES"), 1)
        if node.nnodes > 1:
            if not env.get("MASTER_ADDR"):
                raise BadValue(f"NNODES={node.nnodes} needs MASTER_ADDR (the address of node 0, reachable from every node)")
            node.node_rank, node.master_addr = env.get("NODE_RANK", ""), env["MASTER_ADDR"]
            node.master_port = env.get("MASTER_PORT") or 29500
    elif launcher != "single":
        raise BadValue(f"NANOCHAT_LAUNCHER must be auto, volcengine, slurm, torchrun or single; got '{launcher}'")
    if node.nnodes > 1:
        node.node_rank = _whole(f"the node rank (launcher {launcher})", node.node_rank)
        if node.node_rank >= node.nnodes:
            raise BadValue(f"node rank {node.node_rank} is out of range for {node.nnodes} nodes")
        node.master_port = _whole("the master port", node.master_port, 1)
        if node.master_port > 65535:
            raise BadValue(f"the master port must be 1..65535, got {node.master_port}")
        node.job_key = node.job_key or f"{node.master_addr}-{node.master_port}"
    node.job_key = re.sub(r"[^A-Za-z0-9._-]", "_", env.get("NANOCHAT_RUN_ID") or node.job_key)
    node.ngpu = count_visible_gpus(env)
    if nproc is not None:
        node.nproc, node.nproc_src = _whole("processes per node", nproc, 1), src or "flag or NPROC_PER_NODE"
    elif node.ngpu:
        node.nproc, node.nproc_src = node.ngpu, "visible GPUs"
    else:
        node.nproc, node.nproc_src = 1, "no GPU: 1 process on CPU"
    return node


def torchrun_args(node, training, max_restarts=3):
    """torchrun's own arguments for one stage on this node. Several nodes meet in a c10d rendezvous on node 0's
    address (not a static master), so a restart brings every node back; a training stage is restarted after a
    crash up to max_restarts times (it resumes from its latest checkpoint) and its ranks get the stop signals."""
    if node.nnodes > 1:
        args = [f"--nnodes={node.nnodes}", f"--nproc_per_node={node.nproc}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={node.master_addr}:{node.master_port}", f"--rdzv-id={node.job_key}"]
    else:
        args = ["--standalone", f"--nproc_per_node={node.nproc}"]
    if training:
        args += [f"--max-restarts={max_restarts}", f"--signals-to-handle={STOP_SIGNALS}"]
    return args


# -----------------------------------------------------------------------------
# the stages, declared once for every launcher


@dataclass
class Plan:
    """What the stages need to know: the resolved preset and the launcher's choices."""
    launch: presets.Launch
    run_name: str = "dummy"
    model_tag: str = ""
    ac_every: int = None
    save_every: int = 500
    base_args: list = field(default_factory=list)  # flags passed through to base_train

    def model_args(self):
        """The model-memory flags every training stage gets, each only when it is not the scripts' default (none,
        1, DDP; tests/test_launch.py checks those defaults)."""
        s = self.launch
        args = [] if s.activation_checkpointing == "none" else [f"--activation_checkpointing={s.activation_checkpointing}"]
        args += [] if self.ac_every is None else [f"--ac_every={self.ac_every}"]
        args += [f"--tp_size={s.tp_size}"] if s.tp_size > 1 else []
        return args + (["--use_fsdp=1"] if s.use_fsdp else [])


def stages(plan, mode):
    """[(module, args)] of the torchrun stages: base (pretrain), mid + SFT with their chat evals (posttrain), or both
    (fullrun). Training stages save every plan.save_every steps and start from their latest complete checkpoint."""
    dbs = f"--device_batch_size={plan.launch.device_batch_size}"
    tag = [f"--model_tag={plan.model_tag}"] if plan.model_tag else []
    ev = ["-g", plan.model_tag] if plan.model_tag else []
    run, model = f"--run={plan.run_name}", plan.model_args()
    resume = [f"--save_every={plan.save_every}", "--resume_from_step=auto"]
    out = []
    if mode != "posttrain":
        out += [("scripts.base_train", [f"--depth={plan.launch.depth}", dbs, *model, *tag, run, *resume, *plan.base_args]),
                ("scripts.base_loss", [dbs, *tag]),
                ("scripts.base_eval", tag)]
    if mode != "pretrain":
        out += [("scripts.mid_train", [run, dbs, *model, *tag, *resume]),
                ("scripts.chat_eval", ["-i", "mid", *ev]),
                ("scripts.chat_sft", [run, *plan.launch.sft_args, *model, *tag, *resume]),
                ("scripts.chat_eval", ["-i", "sft", *ev])]
        # RL on GSM8K is optional (as in nanochat): scripts.chat_rl [run, *tag, *resume], then chat_eval -i rl -a GSM8K
    return out


# -----------------------------------------------------------------------------
# running commands, with the stop signals passed on


class Runner:
    """
    Runs (or, in a dry run, prints) each command. A SIGTERM/SIGUSR1 (a preemption notice; on Kubernetes-style
    platforms only the container's first process gets it) or SIGINT/SIGHUP is passed on to the running command,
    which runs in its own session so it gets each signal once; torchrun hands it to the ranks, a training stage
    finishes its step and saves. Then the pipeline stops with exit status 128 + the signal, so the job is requeued
    and the next start resumes.
    """

    def __init__(self, name, dry_run):
        self.name, self.dry_run = name, dry_run
        self.children, self.stopped = [], None
        if not dry_run:
            for sig in FORWARDED:
                signal.signal(sig, self._forward)

    def _forward(self, signum, frame):
        if self.stopped:  # one notice is enough: a second one could cut short the checkpoint being written
            return
        self.stopped = signum
        for child in self.children:
            if child.poll() is None:
                child.send_signal(signum)

    def check_stop(self):
        if self.stopped:
            name = signal.Signals(self.stopped).name
            log(self.name, f"stopped by {name} (a training stage that was running saved its step first); the same "
                           f"command continues from the latest checkpoint (--resume_from_step=auto)")
            for child in self.children:
                if child.poll() is None:
                    child.terminate()
            sys.exit(128 + self.stopped)

    def start(self, argv, env=None):
        """Start argv in the background (None in a dry run)."""
        self.check_stop()
        if self.dry_run:
            return None
        child = subprocess.Popen(argv, env=env, start_new_session=True)
        self.children.append(child)
        return child

    def wait(self, child, argv):
        rc = 0 if child is None else child.wait()  # a signal runs _forward meanwhile; the wait goes on
        self.check_stop()
        if rc != 0:
            log(self.name, f"error: exit status {rc} from {shlex.join(argv)}")
            sys.exit(rc if 0 < rc < 256 else 1)

    def run(self, argv, env=None):
        self.check_stop()
        print(f"RUN: {shlex.join(argv)}", flush=True)
        self.wait(self.start(argv, env), argv)


def interpreter(env):
    """(python, torchrun) argv prefixes: $PYTHON and $TORCHRUN, else python (python3) and torchrun (python -m
    torch.distributed.run)."""
    py = shlex.split(env.get("PYTHON") or ("python" if shutil.which("python") else "python3"))
    if env.get("TORCHRUN"):
        tr = shlex.split(env["TORCHRUN"])
    else:
        tr = ["torchrun"] if shutil.which("torchrun") else [*py, "-m", "torch.distributed.run"]
    return py, tr


def torchrun_stages(runner, tr, node, plan, mode, device_args, max_restarts):
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT))
    for module, args in stages(plan, mode):
        # "--" keeps the script's flags away from torchrun's own option parsing (--run would be ambiguous there)
        script = [*device_args, *args]
        launcher = torchrun_args(node, module in TRAINING, max_restarts)
        runner.run([*tr, *launcher, "-m", module, *(["--", *script] if script else [])])


# -----------------------------------------------------------------------------
# the launchers' flags


def dry_run_flag(what):
    env = os.environ.get("NANOCHAT_DRY_RUN", "0").strip().lower()
    if env not in ("", "0", "1", "true", "false", "yes", "no", "on", "off"):
        raise BadValue(f"NANOCHAT_DRY_RUN expects 0 or 1, got '{env}'")
    return Flag("dry_run", env not in ("", "0", "false", "no", "off"), what)


def env_int(name, default):
    text = os.environ.get(name) or str(default)
    if not re.fullmatch(r"-?\d+", text):
        raise BadValue(f"{name} must be a whole number, got '{text}'")
    return int(text)


def resume_flags():
    return [Flag("save_every", env_int("SAVE_EVERY", 500), "every training stage saves a checkpoint every N steps (-1: "
                 "the final one only; env SAVE_EVERY) and starts from its latest complete one", min=-1),
            Flag("max_restarts", env_int("MAX_RESTARTS", 3), "torchrun restarts a crashed training stage up to N times "
                 "(env MAX_RESTARTS)", min=0)]


def pretrain_flags():
    env = os.environ
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
        *resume_flags(),
        dry_run_flag("print the resolved settings and the commands, run nothing"),
        prog="bash pretrain.sh", description=header("pretrain.sh"))


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


def check_base_train_flags(py, own, rest, flags):
    """A flag pretrain.sh does not know goes on to base_train: base_train checks them all first (NANOCHAT_CHECK_FLAGS:
    parse, then exit), with pretrain.sh's own names accepted and suggested, so a misspelling or a value out of range
    stops here, before any download or torchrun."""
    kinds = {bool: "bool", int: "int", float: "float", str: "str"}
    check = " ".join(f"{f.name}:{kinds[f.type]}" for f in flags.flags())
    env = {**os.environ, "NANOCHAT_CHECK_FLAGS": check, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if subprocess.run([*py, "-m", "scripts.base_train", *own, *rest], env=env, cwd=REPO, stdout=subprocess.DEVNULL).returncode:
        sys.exit(2)


# -----------------------------------------------------------------------------
# pretrain.sh


def prepare(runner, py, node, plan, mode, cfg, env):
    """Rank-0-only work before any torchrun: the data shards and the tokenizer. With several nodes on one shared
    base dir, node 0 prepares and the others wait for its marker file."""
    if mode == "posttrain" or not cfg.prepare:
        return
    base = env["NANOCHAT_BASE_DIR"]
    tok_dir = os.path.join(base, "tokenizer")
    ready = lambda: all(os.path.isfile(os.path.join(tok_dir, f)) for f in ("tokenizer.pkl", "token_bytes.pt"))
    marker = os.path.join(base, ".nanochat_ready", f"prep-{node.job_key}")
    want = f"num_shards={plan.launch.num_shards}"
    shared = env.get("NANOCHAT_SHARED_FS", "1").lower() in ("1", "true", "yes", "on")
    if node.nnodes > 1 and shared and node.node_rank > 0:
        timeout = _whole("NANOCHAT_PREP_TIMEOUT", env.get("NANOCHAT_PREP_TIMEOUT", "14400"))
        print(f"WAIT: for {marker} ({want}) from node 0, up to {timeout}s", flush=True)
        start = time.time()
        while not runner.dry_run and not (os.path.isfile(marker) and open(marker).read().strip() == want):
            runner.check_stop()
            if time.time() - start >= timeout:
                raise BadValue(f"node {node.node_rank} waited {timeout}s for node 0 to download the data and train the "
                               f"tokenizer (marker {marker} never appeared). Check node 0's log. If {base} is not one "
                               f"filesystem shared by all nodes, set NANOCHAT_SHARED_FS=0 so every node prepares its own "
                               f"copy; for a slow download raise NANOCHAT_PREP_TIMEOUT.")
            time.sleep(float(env.get("NANOCHAT_PREP_POLL", "10")))
        if not runner.dry_run:
            if not ready():
                raise BadValue(f"node 0 marked the preparation done but {tok_dir} has no tokenizer.pkl/token_bytes.pt "
                               f"here: is {base} really shared between the nodes? If not, set NANOCHAT_SHARED_FS=0.")
            log("pretrain.sh", f"node 0 finished the preparation after {time.time() - start:.0f}s")
        return
    first = node.nnodes > 1 and shared
    if first and not runner.dry_run and os.path.exists(marker):
        os.remove(marker)  # a marker from an earlier run with this key must not release the other nodes early
    runner.run([*py, "-m", "nanochat.dataset", "-n", str(plan.launch.num_shards)])
    if ready():
        log("pretrain.sh", f"tokenizer found in {tok_dir}: not training one")
    else:
        runner.run([*py, "-m", "scripts.tok_train", f"--max_chars={env.get('TOK_MAX_CHARS', '2000000000')}"])
    if first:
        print(f"WRITE: {marker} ({want}): the other nodes may proceed", flush=True)
        if not runner.dry_run:
            os.makedirs(os.path.dirname(marker), exist_ok=True)
            with open(f"{marker}.tmp.{os.getpid()}", "w") as f:
                f.write(want + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(f"{marker}.tmp.{os.getpid()}", marker)


def run_pretrain(argv):
    flags = pretrain_flags()
    if "-h" in argv or "--help" in argv:
        flags.parse(["--help"])
    # Some platforms (Kubeflow-style PyTorchDDP jobs) export RANK/WORLD_SIZE per node. torchrun sets the per-process
    # values for its children; the plain python steps here (download, tokenizer, report) must not see the node's.
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        os.environ.pop(name, None)
    env = os.environ  # the commands' environment, NANOCHAT_BASE_DIR set below
    py, tr = interpreter(env)
    check_installed(py)
    own, rest = split_args(argv, flags)
    if rest:
        check_base_train_flags(py, own, rest, flags)
    cfg = flags.parse(own)
    wandb = wandb_problem(cfg.run)  # base_train would say so after the download and the tokenizer: say it now
    if wandb:
        raise CannotRun(wandb)
    mode = "fullrun" if cfg.fullrun else "posttrain" if cfg.posttrain else "pretrain"
    node = discover(env, cfg.nproc_per_node or env.get("NPROC_PER_NODE") or None)
    _whole("NANOCHAT_PREP_TIMEOUT", env.get("NANOCHAT_PREP_TIMEOUT", "14400"))  # checked here, used by prepare()
    launch = presets.resolve_launch(
        cfg.depth, rest + ([f"--ac_every={cfg.ac_every}"] if cfg.ac_every else []), num_shards=cfg.num_shards,
        device_batch_size=cfg.device_batch_size, use_fsdp=cfg.use_fsdp, world_size=node.nnodes * node.nproc,
        mode=mode, activation_checkpointing=cfg.activation_checkpointing, tp_size=cfg.tp_size)
    plan = Plan(launch, cfg.run, cfg.model_tag, cfg.ac_every, cfg.save_every, rest)
    env["NANOCHAT_BASE_DIR"] = base = env.get("NANOCHAT_BASE_DIR") or os.path.expanduser("~/.cache/nanochat")
    shared = env.get("NANOCHAT_SHARED_FS", "1")
    if shared.lower() not in ("0", "1", "true", "false", "yes", "no", "on", "off"):
        raise BadValue(f"NANOCHAT_SHARED_FS expects 0 or 1, got '{shared}'")
    settings = dict(
        launcher=node.launcher, nnodes=node.nnodes, node_rank=node.node_rank,
        nproc_per_node=f"{node.nproc} ({node.nproc_src})", world_size=node.nnodes * node.nproc,
        master_addr=node.master_addr or "(standalone)", master_port=node.master_port or "(standalone)",
        hosts=" ".join(node.hosts) or None, mode=mode, depth=launch.depth, num_shards=launch.num_shards,
        device_batch_size=launch.device_batch_size, grad_accum=launch.grad_accum, use_fsdp=int(launch.use_fsdp),
        activation_checkpointing=launch.activation_checkpointing + (f" (ac_every={cfg.ac_every})" if cfg.ac_every else ""),
        tp_size=launch.tp_size, est_gb_per_gpu=f"{launch.est_gb} (upper bound; nanochat.presets)",
        device_type="cuda" if node.ngpu else "auto", model_tag=cfg.model_tag or f"(default: d{launch.depth})",
        run=cfg.run, base_dir=base, shared_fs=shared, prepare=int(cfg.prepare), save_every=cfg.save_every,
        max_restarts=cfg.max_restarts,
        shutdown_timeout=_whole("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", SHUTDOWN_TIMEOUT)))
    log("pretrain.sh", "resolved settings:")
    print("\n".join(f"{k}={v}" for k, v in settings.items() if v is not None), flush=True)
    for note in launch.notes:
        log("pretrain.sh", f"note: {note}")
    if node.nnodes > 1 and shared.lower() in ("0", "false", "no", "off"):
        log("pretrain.sh", "note: NANOCHAT_SHARED_FS=0: a restarted or requeued training stage resumes only if every "
                           "node reads the same checkpoint directory; with node-local base dirs it starts fresh")
    runner = Runner("pretrain.sh", cfg.dry_run)
    if cfg.dry_run:
        log("pretrain.sh", "dry run: printing the commands, running nothing")
    device_args = []
    if node.ngpu:  # GPUs visible: every stage runs on CUDA, once torch is known to see them
        device_args = ["--device_type=cuda"]
        gpu_check = [*py, "-m", "nanochat.setup_check", "gpu"]
        if cfg.dry_run:
            print(f"CHECK: {shlex.join(gpu_check)}")
        elif subprocess.run(gpu_check).returncode:
            return 1
    if not cfg.dry_run:
        os.makedirs(base, exist_ok=True)  # every node makes its own base dir (node-local or not)
    prepare(runner, py, node, plan, mode, cfg, env)
    if mode != "posttrain" and node.node_rank == 0:
        runner.run([*py, "-m", "nanochat.report", "reset"])
    torchrun_stages(runner, tr, node, plan, mode, device_args, cfg.max_restarts)
    if node.node_rank == 0:
        runner.run([*py, "-m", "nanochat.report", "generate"])
    log("pretrain.sh", f"done ({mode})")
    return 0


# -----------------------------------------------------------------------------
# speedrun.sh (and run1000.sh): one 8-GPU node, the whole pipeline, after the shell's setup


def speedrun_flags():
    return Flags(dry_run_flag("print every command, setup included, and run none"), *resume_flags(),
                 prog="bash speedrun.sh", description=header("speedrun.sh"))


def speedrun_launch(env):
    """speedrun.sh's settings from its environment (NPROC, DEPTH, NUM_SHARDS, DEVICE_BATCH), resolved with the depth
    preset: (nproc, depth, presets.Launch). A bad one is a usage error, found by the flag check before any setup."""
    nproc, depth = _whole("NPROC", env.get("NPROC") or "8", 1), _whole("DEPTH", env.get("DEPTH") or "20", 1)
    given = lambda var: _whole(var, env[var], 0) if env.get(var) else None
    return nproc, depth, presets.resolve_launch(depth, num_shards=given("NUM_SHARDS"),
                                                device_batch_size=given("DEVICE_BATCH"), world_size=nproc, mode="fullrun")


def run_speedrun(argv):
    cfg = speedrun_flags().parse(argv)
    env = dict(os.environ)
    py, tr = interpreter(env)
    nproc, depth, launch = speedrun_launch(env)
    for note in launch.notes:
        log("speedrun.sh", f"note: {note}")
    log("speedrun.sh", f"d{depth} on {nproc} GPUs: {launch.num_shards} shards, device batch {launch.device_batch_size}, "
                       f"grad accumulation {launch.grad_accum}, FSDP {int(launch.use_fsdp)}")
    plan = Plan(launch, env.get("WANDB_RUN") or "dummy", save_every=cfg.save_every)
    node = Node("single", nproc=nproc, ngpu=nproc)
    runner = Runner("speedrun.sh", cfg.dry_run)
    base = env["NANOCHAT_BASE_DIR"]
    if not cfg.dry_run:
        os.makedirs(base, exist_ok=True)
    runner.run([*py, "-m", "nanochat.report", "reset"])
    # the tokenizer trains on ~2B characters of the first 8 shards while the rest of the shards download
    runner.run([*py, "-m", "nanochat.dataset", "-n", "8"])
    download = [*py, "-m", "nanochat.dataset", "-n", str(launch.num_shards)]
    print(f"RUN (in the background): {shlex.join(download)}", flush=True)
    child = runner.start(download)
    runner.run([*py, "-m", "scripts.tok_train", "--max_chars=2000000000", "--vocab_size=65536", "--keep_existing"])
    runner.run([*py, "-m", "scripts.tok_eval"])
    if child is not None:
        print("Waiting for the shard download...", flush=True)
    runner.wait(child, download)
    # identity conversations for mid-training (nanochat's file; left out when it cannot be fetched)
    identity = ["curl", "-fsSL", "-o", os.path.join(base, "identity_conversations.jsonl"),
                "https://karpathy-public.s3.us-west-2.amazonaws.com/identity_conversations.jsonl"]
    print(f"RUN: {shlex.join(identity)}", flush=True)
    if not cfg.dry_run and subprocess.run(identity).returncode:
        print("could not download identity_conversations.jsonl; mid-training leaves it out")
    torchrun_stages(runner, tr, node, plan, "fullrun", ["--device_type=cuda"], cfg.max_restarts)
    runner.run([*py, "-m", "nanochat.report", "generate"])
    print(f"Talk to it: {shlex.join(py)} -m scripts.chat_web")
    return 0


# -----------------------------------------------------------------------------


def runcpu_flags():
    """runcpu.sh's flags; its settings from the environment are checked with them (the pipeline itself is bash)."""
    _whole("RUNCPU_BASE_STEPS", os.environ.get("RUNCPU_BASE_STEPS") or "500", 1)
    return Flags(dry_run_flag("print the setup commands it would run (venv, Rust, install), then stop"),
                 prog="bash runcpu.sh", description=header("runcpu.sh"))


def speedrun_check_flags():
    """speedrun.sh's flags and its environment's settings, checked before its setup installs anything."""
    speedrun_launch(os.environ)
    wandb = wandb_problem(os.environ.get("WANDB_RUN") or "dummy")
    if wandb:
        raise CannotRun(wandb.replace("--run=", "WANDB_RUN="))
    return speedrun_flags()


CHECKS = {  # launchers that only ask for their flags (and settings) to be checked (they eval DRY_RUN)
    "runcpu.sh": runcpu_flags,
    "speedrun.sh": speedrun_check_flags,
}
RUNS = {"pretrain.sh": run_pretrain, "speedrun.sh": run_speedrun}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"] and argv[1:2] and argv[1] in RUNS:
        return RUNS[argv[1]](argv[2:])
    if not argv or argv[0] not in CHECKS:  # --help, or a mistake: the launcher comes first
        Flags(Flag("launcher", None, "the launcher whose flags follow", type=str, choices=list(CHECKS),
                   positional=True, required=True),
              dry_run_flag("every launcher's: print what it would run, run nothing (its --help says what exactly)"),
              prog="python3 -m scripts.launch", description=__doc__).parse(argv)
        raise FlagError(f"flags go after the launcher's name: python3 -m scripts.launch LAUNCHER FLAGS ({argv})")
    config = CHECKS[argv[0]]().parse(argv[1:])  # --help prints the help and exits 0; a mistake raises FlagError
    print(f"DRY_RUN={int(config['dry_run'])}")
    return 0


if __name__ == "__main__":
    run_main(main)
