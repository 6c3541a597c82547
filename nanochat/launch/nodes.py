"""
Where this node runs in a launch, read from the environment: Volcengine, Slurm, plain torchrun launchers started by
hand, or one machine; and the arguments torchrun gets for one stage on this node. The launch pipeline
(nanochat/launch/pipeline.py) asks it; tests/integration/test_launch.py feeds it each platform's variables.
"""

import re
import shutil
import subprocess
from dataclasses import dataclass, field

from nanochat.usage import BadValue

# torchrun passes these on to the ranks; without SIGUSR1 in the list (Slurm's --signal) the signal kills torchrun
STOP_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


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


def whole(name, text, minimum=0):
    """The whole number in `text` (an environment variable's value; `name` says which), else a usage error."""
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


def gpu_compute_capability(env):
    """The lowest compute capability of this node's GPUs as (major, minor), from nvidia-smi; None without one (CPU,
    or an nvidia-smi too old to report it)."""
    if not shutil.which("nvidia-smi", path=env.get("PATH")):
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                         text=True, env=env)
    caps = [tuple(int(x) for x in line.strip().split(".")) for line in out.stdout.splitlines()
            if re.fullmatch(r"\d+\.\d+", line.strip())] if out.returncode == 0 else []
    return min(caps) if caps else None


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
        node.nnodes = whole("MLP_WORKER_NUM", env.get("MLP_WORKER_NUM"), 1)
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
        node.nnodes = whole("SLURM_NNODES", slurm_nodes, 1)
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
        node.nnodes = whole("NNODES", env.get("NNODES"), 1)
        if node.nnodes > 1:
            if not env.get("MASTER_ADDR"):
                raise BadValue(f"NNODES={node.nnodes} needs MASTER_ADDR (the address of node 0, reachable from every node)")
            node.node_rank, node.master_addr = env.get("NODE_RANK", ""), env["MASTER_ADDR"]
            node.master_port = env.get("MASTER_PORT") or 29500
    elif launcher != "single":
        raise BadValue(f"NANOCHAT_LAUNCHER must be auto, volcengine, slurm, torchrun or single; got '{launcher}'")
    if node.nnodes > 1:
        node.node_rank = whole(f"the node rank (launcher {launcher})", node.node_rank)
        if node.node_rank >= node.nnodes:
            raise BadValue(f"node rank {node.node_rank} is out of range for {node.nnodes} nodes")
        node.master_port = whole("the master port", node.master_port, 1)
        if node.master_port > 65535:
            raise BadValue(f"the master port must be 1..65535, got {node.master_port}")
        node.job_key = node.job_key or f"{node.master_addr}-{node.master_port}"
    node.job_key = re.sub(r"[^A-Za-z0-9._-]", "_", env.get("NANOCHAT_RUN_ID") or node.job_key)
    node.ngpu = count_visible_gpus(env)
    if nproc is not None:
        node.nproc, node.nproc_src = whole("processes per node", nproc, 1), src or "flag or NPROC_PER_NODE"
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


