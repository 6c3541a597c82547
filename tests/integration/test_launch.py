"""
Multi-node launch: pretrain.sh builds the torchrun commands from the Volcengine / Slurm / plain-torchrun environment
and the depth presets (nanochat/presets.py, the one table every launcher reads); volc/volc_submit.sh writes the
`volc ml_task` job file.

The environments are synthetic (dicts of the variables those platforms set); pretrain.sh runs for real with
--dry_run, and once without it against stand-in `python`/`torchrun` executables that log their arguments, to check
the node-0 preparation and the other nodes' wait on the marker file. Preset values are read from nanochat.presets;
the batch arithmetic they go through is checked with numbers worked out here, from the platforms' conventions.
"""

import os
import re
import shlex
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from nanochat import presets
from nanochat.usage import BadValue
from nanochat.launch import nodes

pytestmark = pytest.mark.cost(0.2)  # seconds per test, in process: the order files are handed out in (conftest.py)

REPO = Path(__file__).resolve().parents[2]
PRETRAIN = REPO / "pretrain.sh"
VOLC_SUBMIT = REPO / "volc" / "volc_submit.sh"

PRESETS = presets.PRESETS
D20 = PRESETS[20].device_batch_size  # 32 (nanochat's speedrun value)
# what a training stage's torchrun gets besides the rendezvous: restarts after a crash, the stop signals passed on to
# the ranks (SIGUSR1 included: Slurm's --signal); and TORCH_ELASTIC_SHUTDOWN_TIMEOUT (300 s, a step and a checkpoint
# write) in its environment, the time it gives the ranks before it kills them
RESTART = ["--max-restarts=3", "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"]
# and what the training script gets: periodic checkpoints, and a start from the latest complete one
RESUME = ["--save_every=500", "--resume_from_step=auto"]


def rdzv(nnodes, nproc, endpoint, job):
    """A multi-node torchrun's rendezvous: c10d on node 0's address, the job's id (no static master, no node rank)."""
    return [f"--nnodes={nnodes}", f"--nproc_per_node={nproc}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={job}"]


def make_exe(path: Path, body: str):
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def base_env(tmp_path, **extra):
    """A clean environment: no inherited SLURM_*/MLP_*/CUDA variables, fixed interpreter and launcher names.
    `python` is this test's interpreter (pretrain.sh asks it for the presets); the commands print as `python`."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir(exist_ok=True)
    if not (fake_bin / "python").exists():
        make_exe(fake_bin / "python", f'exec {shlex.quote(sys.executable)} "$@"\n')
    env = {
        "PATH": f"{fake_bin}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "HOME": str(tmp_path / "home"),
        "NANOCHAT_BASE_DIR": str(tmp_path / "base"),
        "PYTHON": "python",
        "TORCHRUN": "torchrun",
        "CUDA_VISIBLE_DEVICES": "",  # no GPU unless a test says otherwise (the CI machine may have some)
    }
    env.update({k: str(v) for k, v in extra.items()})
    return {k: v for k, v in env.items() if v is not None}


def run_pretrain(tmp_path, *args, env=None, check=True, dry=True):
    env = env if env is not None else base_env(tmp_path)
    cmd = ["bash", str(PRETRAIN)] + (["--dry_run"] if dry else []) + list(args)
    p = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    if check and p.returncode != 0:
        raise AssertionError(f"pretrain.sh failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def parse(stdout):
    """-> (settings dict, list of commands as argv lists, list of all output lines)."""
    settings, commands = {}, []
    lines = stdout.splitlines()
    for line in lines:
        if line.startswith("RUN: "):
            commands.append(shlex.split(line[len("RUN: "):]))
        elif "=" in line and line.split("=", 1)[0].isidentifier() and line.split("=", 1)[0].islower():
            k, v = line.split("=", 1)
            settings[k] = v
    return settings, commands, lines


def torchrun_calls(commands):
    """{module: (torchrun launcher args, script args)} for every torchrun command."""
    calls = {}
    for c in commands:
        if c[0] != "torchrun":
            continue
        m = c.index("-m")
        module = c[m + 1]
        script = c[m + 2:]
        if script[:1] == ["--"]:
            script = script[1:]
        calls[module] = (c[1:m], script)
    return calls


# ----------------------------------------------------------------------------------------------------------------
# single node


def test_single_node_cpu_runs_one_standalone_process(tmp_path):
    p = run_pretrain(tmp_path)
    settings, commands, _ = parse(p.stdout)
    assert settings["launcher"] == "single"
    assert settings["nnodes"] == "1" and settings["world_size"] == "1"
    # order: data, tokenizer, report reset, the three base stages, report
    assert commands[0] == ["python", "-m", "nanochat.dataset", "-n", "240"]
    assert commands[1][:3] == ["python", "-m", "scripts.tok_train"]
    assert commands[2] == ["python", "-m", "nanochat.report", "reset"]
    assert [c[c.index("-m") + 1] for c in commands[3:6]] == ["scripts.base_train", "scripts.base_loss", "scripts.base_eval"]
    assert commands[6] == ["python", "-m", "nanochat.report", "generate"]
    calls = torchrun_calls(commands)
    assert calls["scripts.base_train"] == (
        ["--standalone", "--nproc_per_node=1", *RESTART],
        ["--depth=20", f"--device_batch_size={D20}", "--run=dummy", *RESUME],
    )
    # evaluation stages are neither restarted nor resumed
    assert calls["scripts.base_loss"] == (["--standalone", "--nproc_per_node=1"], [f"--device_batch_size={D20}"])
    assert calls["scripts.base_eval"][1] == []
    # a dry run leaves the disk alone
    assert not (tmp_path / "base").exists()


@pytest.mark.slow  # several launcher subprocesses: seconds
def test_single_node_counts_visible_gpus(tmp_path):
    # 3 GPUs: 524288 tokens are no whole number of 32 x 2048 x 3 micro-batches, so give a total that is
    p = run_pretrain(tmp_path, "--total_batch_size=589824", env=base_env(tmp_path, CUDA_VISIBLE_DEVICES="0,1,3"))
    calls = torchrun_calls(parse(p.stdout)[1])
    assert calls["scripts.base_train"][0] == ["--standalone", "--nproc_per_node=3", *RESTART]
    # visible GPUs: every stage runs on CUDA (never the CPU by accident), after torch is checked to see them
    assert all(args[0] == "--device_type=cuda" for _, args in calls.values())
    assert "CHECK: python -m nanochat.setup_check gpu" in p.stdout
    # no CUDA_VISIBLE_DEVICES: nvidia-smi -L decides
    env = base_env(tmp_path)
    del env["CUDA_VISIBLE_DEVICES"]
    lines = "".join(f"echo 'GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})'\n" for i in range(8))
    make_exe(tmp_path / "bin" / "nvidia-smi", f'[ "$1" = "-L" ] || exit 1\n{lines}')
    p = run_pretrain(tmp_path, env=env)
    settings, commands, _ = parse(p.stdout)
    assert torchrun_calls(commands)["scripts.base_train"][0] == ["--standalone", "--nproc_per_node=8", *RESTART]
    assert settings["world_size"] == "8"
    # an explicit count wins
    p = run_pretrain(tmp_path, "--nproc-per-node", "2", env=env)
    assert torchrun_calls(parse(p.stdout)[1])["scripts.base_train"][0] == ["--standalone", "--nproc_per_node=2", *RESTART]


# ----------------------------------------------------------------------------------------------------------------
# Volcengine


def volc_env(tmp_path, rank, nodes=4, **extra):
    platform = dict(
        MLP_WORKER_NUM=nodes,
        MLP_ROLE_INDEX=rank,
        MLP_WORKER_0_HOST="10.0.0.7",
        MLP_WORKER_0_PORT=23456,
        MLP_WORKER_GPU=8,
        MLP_TASK_ID="t-20250101-abc",
    )
    return base_env(tmp_path, **{**platform, **extra})


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_volcengine_multi_node(tmp_path, rank):
    p = run_pretrain(tmp_path, "--depth=32", env=volc_env(tmp_path, rank))
    settings, commands, lines = parse(p.stdout)
    assert settings["launcher"] == "volcengine"
    assert settings["world_size"] == "32"
    # every node the same rendezvous: node 0's address, the task id
    launcher = rdzv(4, 8, "10.0.0.7:23456", "t-20250101-abc")
    assert settings["node_rank"] == str(rank)
    calls = torchrun_calls(commands)
    # d32's 8 rows x 2048 x 32 processes = 524288 tokens: one micro-step per optimizer step
    assert calls["scripts.base_train"] == (launcher + RESTART, ["--depth=32", "--device_batch_size=8", "--run=dummy", *RESUME])
    assert settings["grad_accum"] == "1"
    assert calls["scripts.base_loss"][0] == launcher and calls["scripts.base_eval"][0] == launcher
    marker = str(tmp_path / "base" / ".nanochat_ready" / "prep-t-20250101-abc")
    downloads = [c for c in commands if c[:3] == ["python", "-m", "nanochat.dataset"]]
    if rank == 0:
        # node 0 downloads and trains the tokenizer, then releases the others; only it writes the report
        assert downloads == [["python", "-m", "nanochat.dataset", "-n", "800"]]
        assert any(l.startswith("WRITE: " + marker) for l in lines)
        assert ["python", "-m", "nanochat.report", "generate"] in commands
    else:
        assert downloads == []
        assert not any(c[:3] == ["python", "-m", "scripts.tok_train"] for c in commands)
        assert any(l.startswith("WAIT: for " + marker) for l in lines)
        assert not any("nanochat.report" in c for c in commands)


@pytest.mark.slow  # several launcher subprocesses: seconds
def test_preset_batch_is_halved_when_one_step_exceeds_the_total_batch(tmp_path):
    # d20 on 4 x 8 GPUs: 32 rows x 2048 tokens x 32 = 2097152 tokens > base_train's 524288 -> 16 -> 8 rows
    assert D20 == 32
    env = volc_env(tmp_path, 0)
    p = run_pretrain(tmp_path, env=env)
    calls = torchrun_calls(parse(p.stdout)[1])
    assert calls["scripts.base_train"][1][:2] == ["--depth=20", "--device_batch_size=8"]
    assert "--total_batch_size=2097152 to keep 32" in p.stdout
    # a larger total batch, or an explicit device batch, is left alone
    calls = torchrun_calls(parse(run_pretrain(tmp_path, "--total_batch_size=2097152", env=env).stdout)[1])
    assert calls["scripts.base_train"][1][1] == "--device_batch_size=32"
    calls = torchrun_calls(parse(run_pretrain(tmp_path, "--device_batch_size=16", "--total_batch_size=1048576",
                                              env=env).stdout)[1])
    assert calls["scripts.base_train"][1][1] == "--device_batch_size=16"
    # an explicit device batch that cannot make the total batch is refused before anything runs
    p = run_pretrain(tmp_path, "--device_batch_size=16", env=env, check=False)
    assert p.returncode != 0 and "--total_batch_size=1048576" in p.stderr
    # a shorter sequence fits twice the rows: 16 x 1024 x 32 = 524288
    calls = torchrun_calls(parse(run_pretrain(tmp_path, "--max_seq_len=1024", env=env).stdout)[1])
    assert calls["scripts.base_train"][1][1] == "--device_batch_size=16"


def test_volcengine_single_worker_is_standalone(tmp_path):
    p = run_pretrain(tmp_path, env=volc_env(tmp_path, 0, nodes=1))
    calls = torchrun_calls(parse(p.stdout)[1])
    assert calls["scripts.base_train"][0] == ["--standalone", "--nproc_per_node=8", *RESTART]


def test_volcengine_missing_master_is_an_error(tmp_path):
    env = volc_env(tmp_path, 1)
    del env["MLP_WORKER_0_HOST"]
    p = run_pretrain(tmp_path, env=env, check=False)
    assert p.returncode != 0 and "MLP_WORKER_0_HOST" in p.stderr
    p = run_pretrain(tmp_path, env=volc_env(tmp_path, 4), check=False)
    assert p.returncode != 0 and "out of range" in p.stderr


# ----------------------------------------------------------------------------------------------------------------
# Slurm


def slurm_env(tmp_path, nodeid, nodelist="gpu[01-03,07]", nnodes=4, **extra):
    return base_env(
        tmp_path,
        SLURM_NNODES=nnodes,
        SLURM_NODEID=nodeid,
        SLURM_JOB_NODELIST=nodelist,
        SLURM_JOB_ID=4242,
        SLURM_GPUS_ON_NODE=8,
        **extra,
    )


@pytest.mark.parametrize("nodeid", [0, 3])
def test_slurm_multi_node(tmp_path, nodeid):
    p = run_pretrain(tmp_path, "--depth", "26", env=slurm_env(tmp_path, nodeid))
    settings, commands, _ = parse(p.stdout)
    assert settings["launcher"] == "slurm"
    assert settings["hosts"] == "gpu01 gpu02 gpu03 gpu07"
    # port: 20000 + job id % 10000, the same on every node of the job; d26's 16 rows x 2048 x 32 halve to 8
    launcher = rdzv(4, 8, "gpu01:24242", "4242")
    assert settings["node_rank"] == str(nodeid)
    assert torchrun_calls(commands)["scripts.base_train"] == (
        launcher + RESTART,
        ["--depth=26", "--device_batch_size=8", "--run=dummy", *RESUME],
    )


def test_slurm_master_port_and_step_nodelist(tmp_path):
    env = slurm_env(tmp_path, 1, nnodes=2, MASTER_PORT=31000, SLURM_STEP_NODELIST="node[7-8]")
    calls = torchrun_calls(parse(run_pretrain(tmp_path, env=env).stdout)[1])
    # inside an srun step the step's own nodes count, not the whole allocation
    assert "--rdzv-endpoint=node7:31000" in calls["scripts.base_train"][0]


def test_slurm_errors(tmp_path):
    p = run_pretrain(tmp_path, env=slurm_env(tmp_path, 0, nnodes=3), check=False)
    assert p.returncode != 0 and "has 4 hosts but SLURM_NNODES=3" in p.stderr
    env = slurm_env(tmp_path, 0, SLURM_STEP_NUM_TASKS=32, SLURM_STEP_NUM_NODES=4)
    p = run_pretrain(tmp_path, env=env, check=False)
    assert p.returncode != 0 and "--ntasks-per-node=1" in p.stderr


def test_slurm_prefers_scontrol(tmp_path):
    env = slurm_env(tmp_path, 1, nodelist="weird-list", nnodes=2)
    make_exe(
        tmp_path / "bin" / "scontrol",
        '[ "$1 $2" = "show hostnames" ] || exit 1\n[ "$3" = "weird-list" ] || exit 1\necho hostA\necho hostB\n',
    )
    calls = torchrun_calls(parse(run_pretrain(tmp_path, env=env).stdout)[1])
    assert "--rdzv-endpoint=hostA:24242" in calls["scripts.base_train"][0]


@pytest.mark.parametrize(
    "nodelist,hosts",
    [
        ("gpu01", ["gpu01"]),
        ("gpu[01-04,07]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
        ("a[1-2],b3,c[5]", ["a1", "a2", "b3", "c5"]),
        ("node[8-10]", ["node8", "node9", "node10"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("gpu[1-2]-ib", ["gpu1-ib", "gpu2-ib"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("x-1.example.com,y[3,5].example.com", ["x-1.example.com", "y3.example.com", "y5.example.com"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert nodes.expand_hostlist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["x[3-1]", "x[1-2", "x[a-b]", "x[]"])
def test_expand_nodelist_rejects_bad_lists(bad):
    with pytest.raises(BadValue, match=re.escape(bad)):
        nodes.expand_hostlist(bad)


# ----------------------------------------------------------------------------------------------------------------
# plain torchrun launchers started by hand, and the override


def test_manual_multi_node_env(tmp_path):
    env = base_env(tmp_path, NNODES=2, NODE_RANK=1, MASTER_ADDR="127.0.0.1", MASTER_PORT=29611, CUDA_VISIBLE_DEVICES="")
    p = run_pretrain(tmp_path, "--nproc_per_node=2", env=env)
    settings, commands, _ = parse(p.stdout)
    assert settings["launcher"] == "torchrun"
    assert settings["node_rank"] == "1"
    # without a scheduler's job id the rendezvous id is the master's address and port, the same on every node
    assert torchrun_calls(commands)["scripts.base_train"][0] == rdzv(2, 2, "127.0.0.1:29611", "127.0.0.1-29611") + RESTART


def test_launcher_override(tmp_path):
    env = slurm_env(tmp_path, 0, NANOCHAT_LAUNCHER="single")
    settings, commands, _ = parse(run_pretrain(tmp_path, env=env).stdout)
    assert settings["launcher"] == "single"
    # a single node counts its visible GPUs (none here), whatever SLURM_GPUS_ON_NODE says
    assert torchrun_calls(commands)["scripts.base_train"][0] == ["--standalone", "--nproc_per_node=1", *RESTART]
    env["NANOCHAT_LAUNCHER"] = "kubernetes"
    p = run_pretrain(tmp_path, env=env, check=False)
    assert p.returncode != 0 and "NANOCHAT_LAUNCHER" in p.stderr


# ----------------------------------------------------------------------------------------------------------------
# presets, overrides, modes


@pytest.mark.parametrize("depth", sorted(PRESETS))
def test_depth_presets(tmp_path, depth):
    shards, dbs, fsdp = PRESETS[depth].num_shards, PRESETS[depth].device_batch_size, PRESETS[depth].use_fsdp
    p = run_pretrain(tmp_path, f"--depth={depth}")
    settings, commands, _ = parse(p.stdout)
    # FineWeb-Edu-100B has 1823 shards: bigger presets download all of them (and say so)
    assert ["python", "-m", "nanochat.dataset", "-n", str(min(shards, 1823))] in commands
    assert settings["num_shards"] == str(min(shards, 1823))
    assert ("downloading 1823" in p.stdout) == (shards > 1823)
    args = torchrun_calls(commands)["scripts.base_train"][1]
    assert args[:2] == [f"--depth={depth}", f"--device_batch_size={dbs}"]
    assert ("--use_fsdp=1" in args) == fsdp
    assert settings["use_fsdp"] == ("1" if fsdp else "0")
    # activation checkpointing and TP: the preset's, passed on only when not the scripts' defaults (none, 1)
    ac, tp = PRESETS[depth].activation_checkpointing, PRESETS[depth].tp_size
    assert settings["activation_checkpointing"] == ac and settings["tp_size"] == str(tp)
    assert ("--activation_checkpointing=" + ac in args) == (ac != "none")
    assert any(a.startswith("--tp_size=") for a in args) == (tp > 1)


@pytest.mark.slow  # several launcher subprocesses: seconds
def test_activation_checkpointing_and_tp_overrides(tmp_path):
    """--activation_checkpointing / --ac_every / --tp_size on pretrain.sh reach every training stage."""
    env = base_env(tmp_path, NPROC_PER_NODE=4)
    p = run_pretrain(tmp_path, "--fullrun", "--activation-checkpointing", "selective", "--ac_every=3", "--tp_size=2",
                     env=env)
    settings, commands, _ = parse(p.stdout)
    assert settings["activation_checkpointing"] == "selective (ac_every=3)" and settings["tp_size"] == "2"
    calls = torchrun_calls(commands)
    model_args = ["--activation_checkpointing=selective", "--ac_every=3", "--tp_size=2"]
    assert calls["scripts.base_train"][1] == ["--depth=20", f"--device_batch_size={D20}", *model_args, "--run=dummy", *RESUME]
    assert calls["scripts.mid_train"][1] == ["--run=dummy", f"--device_batch_size={D20}", *model_args, *RESUME]
    assert calls["scripts.chat_sft"][1][-5:] == model_args + RESUME
    # 4 processes in TP pairs = 2 data-parallel ranks: 32 x 2048 x 2 = 131072 tokens a micro-step, 4 accumulated
    assert settings["grad_accum"] == "4"
    # the override also changes the memory estimate printed with the settings
    full = parse(run_pretrain(tmp_path, "--activation_checkpointing=full").stdout)[0]
    assert float(full["est_gb_per_gpu"].split()[0]) == round(presets.estimate_gb(20, D20, activation_checkpointing="full"), 1)
    assert float(parse(run_pretrain(tmp_path).stdout)[0]["est_gb_per_gpu"].split()[0]) == round(presets.estimate_gb(20, D20), 1)
    # bad values stop before any work, naming the flag
    p = run_pretrain(tmp_path, "--activation_checkpointing=some", check=False)
    assert p.returncode != 0 and "--activation_checkpointing" in p.stderr and "RUN:" not in p.stdout
    p = run_pretrain(tmp_path, "--tp_size=3", env=env, check=False)
    assert p.returncode != 0 and "--tp_size" in p.stderr and "RUN:" not in p.stdout


@pytest.mark.slow  # several launcher subprocesses: seconds
def test_overrides_and_pass_through(tmp_path):
    p = run_pretrain(
        tmp_path,
        "--depth", "40",
        "--use-fsdp=0",
        "--num_shards=10",
        "--device-batch-size", "2",
        "--model_tag=mytag",
        "--run", "my run",
        "--warmup-ratio=0.1",
        "--num_iterations", "-1",
        env=base_env(tmp_path, WANDB_MODE="offline"),  # --run: a wandb run, here without a login (tests/test_user_errors)
    )
    settings, commands, _ = parse(p.stdout)
    assert ["python", "-m", "nanochat.dataset", "-n", "10"] in commands
    calls = torchrun_calls(commands)
    assert calls["scripts.base_train"][1] == [
        "--depth=40",
        "--device_batch_size=2",
        "--model_tag=mytag",
        "--run=my run",
        *RESUME,
        "--warmup_ratio=0.1",
        "--num_iterations=-1",
    ]
    assert calls["scripts.base_loss"][1] == ["--device_batch_size=2", "--model_tag=mytag"]
    assert calls["scripts.base_eval"][1] == ["--model_tag=mytag"]
    # a dataset with more shards than FineWeb-Edu-100B lifts the cap
    env = base_env(tmp_path, NANOCHAT_MAX_SHARDS=3000)
    _, commands, _ = parse(run_pretrain(tmp_path, "--depth=48", env=env).stdout)
    assert ["python", "-m", "nanochat.dataset", "-n", "2500"] in commands
    # FSDP can also be switched on below d40
    args = torchrun_calls(parse(run_pretrain(tmp_path, "--use_fsdp=true").stdout)[1])["scripts.base_train"][1]
    assert "--use_fsdp=1" in args


def test_prepare_off_and_existing_tokenizer(tmp_path):
    _, commands, _ = parse(run_pretrain(tmp_path, "--prepare=0").stdout)
    assert not any(c[:3] in (["python", "-m", "nanochat.dataset"], ["python", "-m", "scripts.tok_train"]) for c in commands)
    tok = tmp_path / "base" / "tokenizer"
    tok.mkdir(parents=True)
    (tok / "tokenizer.pkl").write_bytes(b"x")
    (tok / "token_bytes.pt").write_bytes(b"x")
    _, commands, _ = parse(run_pretrain(tmp_path).stdout)
    assert ["python", "-m", "nanochat.dataset", "-n", "240"] in commands
    assert not any(c[:3] == ["python", "-m", "scripts.tok_train"] for c in commands)


def test_posttrain_and_fullrun(tmp_path):
    _, commands, _ = parse(run_pretrain(tmp_path, "--posttrain", "--depth=40", "--model_tag=t").stdout)
    mods = [c[c.index("-m") + 1] for c in commands if c[0] == "torchrun"]
    assert mods == ["scripts.mid_train", "scripts.chat_eval", "scripts.chat_sft", "scripts.chat_eval"]
    evals = [torchrun_calls([c])["scripts.chat_eval"][1] for c in commands if "scripts.chat_eval" in c]
    assert evals == [["-i", "mid", "-g", "t"], ["-i", "sft", "-g", "t"]]
    calls = torchrun_calls(commands)
    assert calls["scripts.mid_train"][1] == ["--run=dummy", "--device_batch_size=1", "--use_fsdp=1", "--model_tag=t", *RESUME]
    assert calls["scripts.chat_sft"][1] == ["--run=dummy", "--device_batch_size=1", "--use_fsdp=1", "--model_tag=t", *RESUME]
    # posttrain downloads nothing and keeps the existing report sections
    assert not any(c[:3] == ["python", "-m", "nanochat.dataset"] for c in commands)
    assert ["python", "-m", "nanochat.report", "reset"] not in commands

    _, commands, _ = parse(run_pretrain(tmp_path, "--fullrun").stdout)
    mods = [c[c.index("-m") + 1] for c in commands if c[0] == "torchrun"]
    assert mods == ["scripts.base_train", "scripts.base_loss", "scripts.base_eval",
                    "scripts.mid_train", "scripts.chat_eval", "scripts.chat_sft", "scripts.chat_eval"]
    # d20's 32 rows are not chat_sft's business: its own default stays
    assert torchrun_calls(commands)["scripts.chat_sft"][1] == ["--run=dummy", *RESUME]


@pytest.mark.parametrize(
    "nodes,gpus,depth,sft_args",
    [
        (1, 8, 20, []),  # 4 x 8 = 32: chat_sft's defaults as they are
        (2, 8, 32, ["--device_batch_size=2"]),  # 2 x 16 = 32
        (4, 8, 32, ["--device_batch_size=1"]),  # 1 x 32 = 32
        (8, 8, 32, ["--device_batch_size=1", "--target_examples_per_step=64"]),  # 64 processes: one conversation each
        (3, 8, 40, ["--device_batch_size=1", "--target_examples_per_step=48", "--use_fsdp=1"]),  # 24 processes
    ],
)
def test_chat_sft_batch_fits_the_world(tmp_path, nodes, gpus, depth, sft_args):
    env = volc_env(tmp_path, 0, nodes=nodes, MLP_WORKER_GPU=gpus)
    if nodes == 1:
        env = base_env(tmp_path, NPROC_PER_NODE=gpus)
    calls = torchrun_calls(parse(run_pretrain(tmp_path, "--posttrain", f"--depth={depth}", env=env).stdout)[1])
    assert calls["scripts.chat_sft"][1] == ["--run=dummy"] + sft_args + RESUME


@pytest.mark.slow  # several launcher subprocesses: seconds
def test_bad_depth_and_flags(tmp_path):
    p = run_pretrain(tmp_path, "--depth=21", check=False)
    assert p.returncode != 0
    assert "--depth=21" in p.stderr
    for d in PRESETS:
        assert f"d{d}" in p.stderr
    assert run_pretrain(tmp_path, "--depth=big", check=False).returncode != 0
    # another depth works when the two preset values are given
    _, commands, _ = parse(run_pretrain(tmp_path, "--depth=4", "--num_shards=3", "--device_batch_size=2").stdout)
    assert torchrun_calls(commands)["scripts.base_train"][1][:2] == ["--depth=4", "--device_batch_size=2"]
    p = run_pretrain(tmp_path, "extra", check=False)
    assert p.returncode != 0 and "unexpected argument 'extra'" in p.stderr
    p = run_pretrain(tmp_path, "--matrix_lr", check=False)
    assert p.returncode != 0 and "--matrix_lr needs a value" in p.stderr
    p = run_pretrain(tmp_path, "--use_fsdp=maybe", check=False)
    assert p.returncode != 0 and "use_fsdp" in p.stderr


# ----------------------------------------------------------------------------------------------------------------
# real (not dry) runs with stand-in python and torchrun: node 0 prepares, the other nodes wait for its marker


def install_fakes(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    # python: logs its arguments; the "download" takes a moment so the waiting node really waits;
    # tok_train writes the two tokenizer files where the real one does
    make_exe(
        bin_dir / "python",
        # the launcher's own questions (presets, GPU check) go to the real interpreter, unlogged
        f'case "$*" in "-m scripts.launch "* | "-m nanochat.presets "* | "-m nanochat.setup_check "*) exec {shlex.quote(sys.executable)} "$@" ;; esac\n'
        'echo "python $*" >> "$CALL_LOG"\n'
        # a node-level RANK from the platform would make the single-process steps think they are distributed
        '[ -z "${RANK:-}${WORLD_SIZE:-}${LOCAL_RANK:-}" ] || { echo "RANK leaked" >&2; exit 9; }\n'
        'case "$*" in\n'
        '  *nanochat.dataset*) sleep 1 ;;\n'
        '  *scripts.tok_train*) mkdir -p "$NANOCHAT_BASE_DIR/tokenizer"; '
        'touch "$NANOCHAT_BASE_DIR/tokenizer/tokenizer.pkl" "$NANOCHAT_BASE_DIR/tokenizer/token_bytes.pt" ;;\n'
        "esac\n",
    )
    make_exe(
        bin_dir / "torchrun",
        'echo "torchrun $*" >> "$CALL_LOG"\n'
        'case "$*" in *"$FAIL_MODULE"*) [ -n "$FAIL_MODULE" ] && exit 3 ;; esac\nexit 0\n',
    )


def real_env(tmp_path, rank, log, **extra):
    env = volc_env(tmp_path, rank, nodes=2, CALL_LOG=log, NANOCHAT_PREP_POLL="0.2", RANK=rank, WORLD_SIZE=2,
                   LOCAL_RANK=0, **extra)
    env["PATH"] = f"{tmp_path / 'bin'}:/usr/bin:/bin"
    return env


@pytest.mark.slow  # two launcher subprocesses, one waiting on the other: seconds
def test_node0_prepares_and_other_node_waits(tmp_path):
    install_fakes(tmp_path)
    log0, log1 = tmp_path / "node0.log", tmp_path / "node1.log"
    cmd = ["bash", str(PRETRAIN), "--depth=20"]
    waiting = subprocess.Popen(
        cmd, env=real_env(tmp_path, 1, log1, NANOCHAT_PREP_TIMEOUT=60), cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    time.sleep(0.5)
    assert waiting.poll() is None  # still waiting for node 0
    node0 = subprocess.run(cmd, env=real_env(tmp_path, 0, log0), cwd=REPO, capture_output=True, text=True, timeout=60)
    out1, err1 = waiting.communicate(timeout=60)
    assert node0.returncode == 0, node0.stdout + node0.stderr
    assert waiting.returncode == 0, out1 + err1
    calls0 = log0.read_text().splitlines()
    calls1 = log1.read_text().splitlines()
    assert calls0[0] == "python -m nanochat.dataset -n 240"
    assert calls0[1].startswith("python -m scripts.tok_train")
    assert calls0[2] == "python -m nanochat.report reset"
    assert [c.split(" -m ")[1].split()[0] for c in calls0[3:6]] == ["scripts.base_train", "scripts.base_loss", "scripts.base_eval"]
    assert calls0[6] == "python -m nanochat.report generate"
    # node 1: no data, no tokenizer, no report; the same torchrun stages with its own rank
    assert all(c.startswith("torchrun ") for c in calls1) and len(calls1) == 3
    assert calls1[0].split(" -m ")[0] == calls0[3].split(" -m ")[0]  # one rendezvous: the same torchrun arguments
    assert "--rdzv-endpoint=10.0.0.7:23456" in calls1[0]
    assert "node 0 finished the preparation" in out1
    marker = tmp_path / "base" / ".nanochat_ready" / "prep-t-20250101-abc"
    assert marker.read_text().strip() == "num_shards=240"
    # the final torchrun command is printed before it runs
    assert any(l.startswith("RUN: torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d")
               for l in node0.stdout.splitlines())


def test_waiting_node_times_out_with_a_clear_message(tmp_path):
    install_fakes(tmp_path)
    log1 = tmp_path / "node1.log"
    env = real_env(tmp_path, 1, log1, NANOCHAT_PREP_TIMEOUT=1)
    t0 = time.time()
    p = subprocess.run(["bash", str(PRETRAIN)], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert time.time() - t0 < 30
    assert "waited 1s" in p.stderr and "NANOCHAT_SHARED_FS=0" in p.stderr and "prep-t-20250101-abc" in p.stderr
    assert not log1.exists()  # nothing was launched


def test_node_local_base_dir_prepares_on_every_node(tmp_path):
    install_fakes(tmp_path)
    log1 = tmp_path / "node1.log"
    env = real_env(tmp_path, 1, log1, NANOCHAT_SHARED_FS=0)
    p = subprocess.run(["bash", str(PRETRAIN)], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    calls = log1.read_text().splitlines()
    assert calls[0] == "python -m nanochat.dataset -n 240" and calls[1].startswith("python -m scripts.tok_train")
    assert not (tmp_path / "base" / ".nanochat_ready").exists()
    # auto resume reads the checkpoint on every rank: node-local base dirs are said to defeat it
    assert "NANOCHAT_SHARED_FS=0: a restarted or requeued training stage resumes only if every node" in p.stdout


@pytest.mark.slow  # a launcher subprocess running its stages: seconds
def test_failed_stage_stops_the_pipeline(tmp_path):
    install_fakes(tmp_path)
    log = tmp_path / "calls.log"
    env = base_env(tmp_path, CALL_LOG=log, FAIL_MODULE="scripts.base_train")
    env["PATH"] = f"{tmp_path / 'bin'}:/usr/bin:/bin"
    p = run_pretrain(tmp_path, env=env, check=False, dry=False)
    assert p.returncode == 3
    calls = log.read_text()
    assert "scripts.base_train" in calls and "scripts.base_loss" not in calls and "report generate" not in calls


# ----------------------------------------------------------------------------------------------------------------
# volc/volc_submit.sh


def run_submit(tmp_path, *args, env_extra=None, check=True):
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}", "HOME": str(tmp_path / "home")}
    env.update(env_extra or {})
    (tmp_path / "bin").mkdir(exist_ok=True)
    p = subprocess.run(["bash", str(VOLC_SUBMIT), *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    if check and p.returncode != 0:
        raise AssertionError(f"volc_submit.sh failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def test_volc_submit_dry_run_writes_the_job_yaml(tmp_path):
    out = tmp_path / "job.yaml"
    code = tmp_path / "code"
    code.mkdir()
    p = run_submit(
        tmp_path,
        "--dry-run", "--out", str(out), "--task_name", "nc-test",
        "--image", "vemlp-cn-beijing.cr.volces.com/preset-images/pytorch:2.9",
        "--queue", "q-2025-abc", "--flavor", "ml.hpcpni2l.28xlarge",
        "--storage", "vepfs:vepfs-123:/vepfs:team/me",
        "--env", "WANDB_API_KEY=secret", "--env", "NOTE=it's fine",
        "--upload_dir", str(code),
        "bash", "pretrain.sh", "--depth=32", "--run", "my run",
        env_extra={"NNODES": "4"},
    )
    job = yaml.safe_load(out.read_text())
    assert job["TaskName"] == "nc-test"
    assert job["ImageUrl"] == "vemlp-cn-beijing.cr.volces.com/preset-images/pytorch:2.9"
    assert job["ResourceQueueID"] == "q-2025-abc"
    assert job["Framework"] == "PyTorchDDP"
    assert job["TaskRoleSpecs"] == [{"RoleName": "worker", "RoleReplicas": 4, "Flavor": "ml.hpcpni2l.28xlarge"}]
    assert job["Storages"] == [{"Type": "Vepfs", "VepfsId": "vepfs-123", "MountPath": "/vepfs", "SubPath": "team/me"}]
    envs = {e["Name"]: e for e in job["Envs"]}
    assert envs["NANOCHAT_BASE_DIR"]["Value"] == "/vepfs/nanochat"
    assert envs["NANOCHAT_SHARED_FS"]["Value"] == "1"
    assert envs["WANDB_API_KEY"] == {"Name": "WANDB_API_KEY", "Value": "secret", "IsPrivate": True}
    assert envs["NOTE"]["Value"] == "it's fine" and envs["NOTE"]["IsPrivate"] is False
    assert job["UserCodePath"] == str(code) + "/"
    assert job["RemoteMountCodePath"] == "/root/code/nanochat"
    assert isinstance(job["ActiveDeadlineSeconds"], int)
    assert job["Entrypoint"].startswith("cd /root/code/nanochat && ")
    # the dry run printed the file and did not submit
    assert "TaskRoleSpecs:" in p.stdout and "would run: volc ml_task submit --conf " + str(out) in p.stdout
    assert stat.S_IMODE(out.stat().st_mode) & 0o077 == 0  # private values inside: owner-only


def test_volc_entrypoint_runs_the_exact_command(tmp_path):
    """Parse the YAML, run its Entrypoint with bash in a stand-in code dir: the command gets the same argv."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "pretrain.sh").write_text('for a in "$@"; do printf "%s\\n" "$a"; done\n')
    out = tmp_path / "job.yaml"
    args = ["--depth=32", "--run", "my run", "--note=it's \"quoted\" $HOME"]
    run_submit(tmp_path, "--dry-run", "--out", str(out), "--code_dir", str(code), "--no_upload",
               "--", "bash", "pretrain.sh", *args)
    job = yaml.safe_load(out.read_text())
    assert "UserCodePath" not in job
    p = subprocess.run(["bash", "-c", job["Entrypoint"]], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == args


def test_volc_submit_defaults_and_placeholders(tmp_path):
    out = tmp_path / "job.yaml"
    p = run_submit(tmp_path, "--dry-run", "--out", str(out), "--no_upload", env_extra={"NNODES": "2"})
    job = yaml.safe_load(out.read_text())
    # exec: pretrain.sh replaces the entrypoint's shell and gets the platform's stop signal itself
    assert job["Entrypoint"] == "cd /root/code/nanochat && exec bash pretrain.sh"
    assert job["TaskName"].startswith("nanochat-n2-")
    assert job["TaskRoleSpecs"][0]["RoleReplicas"] == 2
    assert job["ImageUrl"] == "<IMAGE_URL>" and job["ResourceQueueID"] == "<RESOURCE_QUEUE_ID>"
    assert "placeholders for: image queue flavor" in p.stdout
    # no storage: each container is its own filesystem, so each node prepares its own data
    assert {e["Name"]: e["Value"] for e in job["Envs"]}["NANOCHAT_SHARED_FS"] == "0"
    assert job["Storages"] == []
    assert "lost when the task ends" in p.stdout


def test_volc_submit_requires_image_queue_flavor(tmp_path):
    p = run_submit(tmp_path, "--out", str(tmp_path / "j.yaml"), "bash", "pretrain.sh", check=False)
    assert p.returncode != 0 and "IMAGE" in p.stderr
    p = run_submit(tmp_path, "--out", str(tmp_path / "j.yaml"), env_extra={"IMAGE": "img"}, check=False)
    assert p.returncode != 0 and "QUEUE_ID" in p.stderr
    p = run_submit(tmp_path, "--out", str(tmp_path / "j.yaml"), env_extra={"IMAGE": "img", "QUEUE_ID": "q"}, check=False)
    assert p.returncode != 0 and "FLAVOR" in p.stderr
    p = run_submit(tmp_path, "--dry-run", "--storage", "vepfs:relative", check=False)
    assert p.returncode != 0 and "--storage" in p.stderr
    p = run_submit(tmp_path, "--dry-run", "--nnodes", "zero", check=False)
    assert p.returncode != 0 and "NNODES" in p.stderr


def test_volc_submit_calls_the_cli(tmp_path):
    (tmp_path / "bin").mkdir()
    record = tmp_path / "volc_args"
    make_exe(tmp_path / "bin" / "volc", f'printf "%s\\n" "$@" > {record}\ncp "$4" {tmp_path}/submitted.yaml\n')
    out = tmp_path / "job.yaml"
    env = {"IMAGE": "img:1", "QUEUE_ID": "q-1", "FLAVOR": "ml.x", "NNODES": "3", "STORAGES": "nas:cnas-1:/nas"}
    p = run_submit(tmp_path, "--out", str(out), "--no_upload", "bash", "pretrain.sh", "--depth=20", env_extra=env)
    assert record.read_text().splitlines() == ["ml_task", "submit", "--conf", str(out)]
    job = yaml.safe_load((tmp_path / "submitted.yaml").read_text())
    assert job["TaskRoleSpecs"][0]["RoleReplicas"] == 3 and job["TaskName"].startswith("nanochat-d20-n3-")
    assert job["Storages"] == [{"Type": "Nas", "NasId": "cnas-1", "MountPath": "/nas"}]
    assert "RUN: volc ml_task submit --conf" in p.stdout


def test_volc_submit_without_cli_says_how_to_install(tmp_path):
    env = {"IMAGE": "i", "QUEUE_ID": "q", "FLAVOR": "f", "PATH": "/usr/bin:/bin"}
    p = run_submit(tmp_path, "--out", str(tmp_path / "j.yaml"), "--no_upload", env_extra=env, check=False)
    if subprocess.run(["bash", "-c", "command -v volc"], env={"PATH": "/usr/bin:/bin"}).returncode == 0:
        pytest.skip("a real volc CLI is installed in /usr/bin")
    assert p.returncode != 0 and "volc CLI is not installed" in p.stderr and "--dry-run" in p.stderr


@pytest.mark.slow  # several launcher subprocesses: seconds
def test_indivisible_total_batch_is_refused_before_any_work(tmp_path):
    """3 nodes x 8 GPUs at d20: no device batch makes 524288 tokens whole micro-batches; say so up front."""
    env = slurm_env(tmp_path, 0, nodelist="gpu[01-03]", nnodes=3)
    p = run_pretrain(tmp_path, "--depth=20", env=env, check=False)
    assert p.returncode != 0
    # 32 rows halve to 8 (8 x 2048 x 24 = 393216 <= 524288), which does not divide 524288: both neighbours suggested
    assert "not divisible" in p.stderr and "--total_batch_size=393216 or 786432" in p.stderr
    assert "RUN:" not in p.stdout  # nothing was launched or prepared
    # the suggested total works
    p = run_pretrain(tmp_path, "--depth=20", "--total_batch_size=786432", env=env)
    assert "--total_batch_size=786432" in " ".join(torchrun_calls(parse(p.stdout)[1])["scripts.base_train"][1])


# ----------------------------------------------------------------------------------------------------------------
# the one preset table (nanochat/presets.py) and what reads it


@pytest.mark.slow  # imports torch in subprocesses
def test_gpu_node_stops_when_torch_cannot_use_the_gpus(tmp_path):
    """nvidia-smi lists GPUs, torch here has no CUDA device: pretrain.sh stops before any download or torchrun."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a usable GPU")
    install_fakes(tmp_path)
    log = tmp_path / "calls.log"
    env = base_env(tmp_path, CALL_LOG=log)
    del env["CUDA_VISIBLE_DEVICES"]
    env["PATH"] = f"{tmp_path / 'bin'}:/usr/bin:/bin"
    make_exe(tmp_path / "bin" / "nvidia-smi", '[ "$1" = "-L" ] && echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"\n'
                                              '[ "$1" = "-L" ] || echo 535.104.05\n')
    p = run_pretrain(tmp_path, env=env, check=False, dry=False)
    assert p.returncode == 1
    assert torch.__version__ in p.stderr and (torch.version.cuda or "CPU-only wheel") in p.stderr
    assert "download.pytorch.org/whl" in p.stderr
    assert not log.exists()  # nothing downloaded, nothing launched


def test_presets_agree_with_the_training_scripts_defaults():
    from nanochat.gpt import AC_MODES
    from scripts import base_train, chat_sft, mid_train

    assert base_train.DEFAULTS["total_batch_size"] == presets.TOTAL_BATCH_SIZE
    # pretrain.sh leaves out --activation_checkpointing=none (and --tp_size=1): the scripts' defaults must be those
    assert presets.AC_MODES == AC_MODES
    for script in (base_train, mid_train, chat_sft):
        assert script.DEFAULTS["activation_checkpointing"] == "none", script.__name__
        assert script.DEFAULTS.get("tp_size", 1) == 1, script.__name__
    assert base_train.DEFAULTS["max_seq_len"] == presets.MAX_SEQ_LEN
    assert chat_sft.DEFAULTS["device_batch_size"] == presets.SFT_DEVICE_BATCH_SIZE
    assert chat_sft.DEFAULTS["target_examples_per_step"] == presets.SFT_TARGET_EXAMPLES
    # chat_sft checks its batch with the function the launchers fit it with
    assert chat_sft.sft_batch_arithmetic is presets.sft_batch_arithmetic
    assert presets.sft_batch_arithmetic(32, 4, 4) == 2
    with pytest.raises(ValueError, match=r"--target_examples_per_step=32 is not divisible by .* = 3 \* 4 = 12"):
        presets.sft_batch_arithmetic(32, 3, 4)
    # the parameter count behind the table is the model's
    from nanochat.gpt import GPT, config_for_depth

    import torch

    with torch.device("meta"):
        model = GPT(config_for_depth(4, presets.VOCAB_SIZE, 256))
    assert sum(p.numel() for p in model.parameters()) == presets.model_shape(4)[2]


def test_preset_device_batches_follow_the_stated_rule():
    """DDP depths: the largest power of two whose estimate is at most that of nanochat's measured d20 x 32."""
    budget = presets.estimate_gb(20, 32)
    for depth, p in PRESETS.items():
        if p.use_fsdp:
            assert p.device_batch_size == 1 and depth >= presets.FSDP_FROM_DEPTH
            continue
        rows = p.device_batch_size
        assert rows & (rows - 1) == 0
        assert presets.estimate_gb(depth, rows) <= budget < presets.estimate_gb(depth, 2 * rows), depth
    assert (PRESETS[20].device_batch_size, PRESETS[32].device_batch_size) == (32, 8)  # nanochat's measured values


def test_preset_activation_checkpointing_and_tp_follow_the_stated_reasoning():
    """The AC and TP columns (reasoned in the comment above PRESETS): off at every depth, because every preset
    fits the budget without them; AC's estimate counts what GPT.set_activation_checkpointing really checkpoints."""
    import torch

    from nanochat.gpt import GPT, GPTConfig

    for depth, p in PRESETS.items():
        assert p.activation_checkpointing in presets.AC_MODES and p.tp_size >= 1
        est = presets.estimate_gb(depth, p.device_batch_size, state_shards=8 if p.use_fsdp else 1,
                                  activation_checkpointing=p.activation_checkpointing)
        assert est <= presets.BUDGET_GB, depth
        if p.activation_checkpointing == "none":  # AC would only be bought for a batch that does not fit without it
            assert p.tp_size == 1
    # the estimate falls with AC: full < selective < none, and full keeps ~1/17 of the block activations
    for depth in PRESETS:
        none, sel, full = (presets.estimate_gb(depth, 1, activation_checkpointing=m) for m in ("none", "selective", "full"))
        assert full < sel < none
    # the count of checkpointed blocks is the model's own
    with torch.device("meta"):
        model = GPT(GPTConfig(sequence_len=16, vocab_size=64, n_layer=7, n_head=1, n_kv_head=1, n_embd=64), attn="sdpa")
    for mode, every in [("none", 2), ("full", 2), ("selective", 2), ("selective", 3), ("selective", 7)]:
        assert len(model.set_activation_checkpointing(mode, every)) == presets.checkpointed_blocks(7, mode, every)


def test_resolve_with_tp_and_the_memory_note():
    # TP divides the data-parallel width: 16 processes in TP groups of 2 batch like 8 DDP ranks
    plain, tp = presets.resolve(20, world_size=8), presets.resolve(20, world_size=16, tp_size=2)
    assert (plain.device_batch_size, plain.grad_accum) == (tp.device_batch_size, tp.grad_accum) == (32, 1)
    assert (tp.tp_size, tp.activation_checkpointing) == (2, "none")
    with pytest.raises(ValueError, match="--tp_size must .* divides the world size 6, got 4"):
        presets.resolve(20, world_size=6, tp_size=4)
    # more data-parallel ranks than rows in the total batch (256 rows of 2048): TP or a bigger total, named
    with pytest.raises(ValueError, match=r"--total_batch_size=1048576 or --tp_size=2 "):
        presets.resolve(64, world_size=512)
    assert presets.resolve(64, world_size=512, tp_size=2).grad_accum == 1
    # an FSDP depth on too few GPUs: a note with the estimate (an upper bound, so not a refusal)
    few = presets.resolve(64, world_size=2)
    assert any("126 GB per GPU exceeds" in n and "use more GPUs" in n for n in few.notes), few.notes
    four = presets.resolve(64, world_size=4)
    assert four.est_gb == round(presets.estimate_gb(64, 1, state_shards=4), 1) and not any("exceeds" in n for n in four.notes)
    # where full AC is the fix, the note says so
    long = presets.resolve(20, world_size=1, device_batch_size=32, max_seq_len=4096, total_batch_size=4096 * 32)
    assert any("--activation_checkpointing=full brings it to" in n for n in long.notes), long.notes
    assert not presets.resolve(20, world_size=1, device_batch_size=32, max_seq_len=4096, total_batch_size=4096 * 32,
                               activation_checkpointing="full").notes
    with pytest.raises(ValueError, match="--activation_checkpointing must be one of none|full|selective"):
        presets.resolve(20, activation_checkpointing="some")


def test_docs_show_the_preset_table():
    assert presets.markdown_table() in (REPO / "docs" / "multinode.md").read_text()
    p = subprocess.run([sys.executable, "-m", "nanochat.presets", "--format", "markdown"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == presets.markdown_table()


def test_presets_command_uses_the_training_batch_arithmetic():
    from scripts import base_train, mid_train

    # the launchers' arithmetic is the training scripts' own function, not a copy
    assert base_train.batch_arithmetic is mid_train.batch_arithmetic is presets.batch_arithmetic
    launch = presets.resolve(20, world_size=8, mode="fullrun")
    assert (launch.device_batch_size, launch.grad_accum, launch.sft_args) == (32, 1, [])
    with pytest.raises(ValueError, match="--total_batch_size=393216 or 786432"):
        presets.resolve(20, world_size=24)
    # the shell format is what the launchers eval
    p = subprocess.run(["bash", "-c", 'eval "$(python3 -m nanochat.presets --format shell --depth 32 --world_size 64 '
                        '--mode fullrun -- --max_seq_len=1024)"; echo "$DEVICE_BATCH_SIZE|$GRAD_ACCUM|${SFT_ARGS[*]}"'],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    # 8 rows x 1024 x 64 = 524288: no halving; chat_sft: 1 conversation x 64 processes = 64 per step
    assert p.stdout.strip() == "8|1|--device_batch_size=1 --target_examples_per_step=64", p.stderr


@pytest.mark.slow  # the installed-check imports torch in a subprocess per script
@pytest.mark.parametrize("script,depth,shards,rows", [("speedrun.sh", 20, 240, 32), ("run1000.sh", 32, 800, 8)])
def test_speedrun_and_run1000_read_the_presets(tmp_path, script, depth, shards, rows):
    assert (PRESETS[depth].num_shards, PRESETS[depth].device_batch_size) == (shards, rows)
    venv = Path(sys.executable).parents[1]
    env = {**base_env(tmp_path), "NANOCHAT_VENV": str(venv), "NANOCHAT_DRY_RUN": "1"}
    p = subprocess.run(["bash", str(REPO / script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    commands = [shlex.split(l[len("RUN: "):]) for l in p.stdout.splitlines() if l.startswith("RUN: ")]
    assert [str(venv / "bin" / "python"), "-m", "nanochat.dataset", "-n", "8"] in commands
    assert f"-m nanochat.dataset -n {shards}" in p.stdout
    base = next(c for c in commands if "scripts.base_train" in c)
    assert base[base.index("--") + 1:] == ["--device_type=cuda", f"--depth={depth}", f"--device_batch_size={rows}",
                                           "--run=dummy", *RESUME]
    assert base[1:base.index("-m")] == ["--standalone", "--nproc_per_node=8", *RESTART]
    # every torchrun stage runs on CUDA, after the GPU check
    assert all(c[c.index("--") + 1] == "--device_type=cuda" for c in commands if "torchrun" in c[0])
    assert f"CHECK: {venv}/bin/python -m nanochat.setup_check gpu" in p.stdout


# ----------------------------------------------------------------------------------------------------------------
# nanochat/launch/nodes.py in-process: where a node runs, and what a training stage's torchrun gets


def test_discover_reads_each_platform():
    gpus = {"CUDA_VISIBLE_DEVICES": ""}
    volc = nodes.discover({**gpus, "MLP_WORKER_NUM": "2", "MLP_ROLE_INDEX": "1", "MLP_WORKER_0_HOST": "10.1.2.3",
                            "MLP_WORKER_0_PORT": "2222", "MLP_WORKER_GPU": "8", "MLP_TASK_ID": "t-1"})
    assert (volc.launcher, volc.nnodes, volc.node_rank, volc.master_addr, volc.master_port, volc.nproc, volc.job_key) == \
        ("volcengine", 2, 1, "10.1.2.3", 2222, 8, "t-1")
    slurm = nodes.discover({**gpus, "SLURM_JOB_NUM_NODES": "3", "SLURM_NODEID": "2", "SLURM_JOB_ID": "77",
                             "SLURM_JOB_NODELIST": "n[08-10]", "SLURM_GPUS_ON_NODE": "4"})
    assert (slurm.launcher, slurm.node_rank, slurm.hosts, slurm.master_addr, slurm.master_port, slurm.nproc) == \
        ("slurm", 2, ["n08", "n09", "n10"], "n08", 20077, 4)
    assert nodes.torchrun_args(slurm, training=False) == rdzv(3, 4, "n08:20077", "77")
    assert nodes.torchrun_args(slurm, training=True, max_restarts=5)[-2:] == ["--max-restarts=5", *RESTART[1:]]
    plain = nodes.discover({**gpus, "NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "h0", "NANOCHAT_RUN_ID": "my job"},
                            nproc=2)
    assert (plain.launcher, plain.master_port, plain.job_key, plain.nproc_src) == ("torchrun", 29500, "my_job", "flag or NPROC_PER_NODE")
    single = nodes.discover({"CUDA_VISIBLE_DEVICES": "0,1", "NNODES": "1"})
    assert (single.launcher, single.nproc, single.ngpu) == ("single", 2, 2)
    assert nodes.torchrun_args(single, training=False) == ["--standalone", "--nproc_per_node=2"]
    with pytest.raises(BadValue, match="node rank 3 is out of range for 2 nodes"):
        nodes.discover({**gpus, "NNODES": "2", "NODE_RANK": "3", "MASTER_ADDR": "h0"})
    with pytest.raises(BadValue, match="MLP_WORKER_NUM must be a whole number >= 1, got 'two'"):
        nodes.discover({**gpus, "MLP_WORKER_NUM": "two"})


@pytest.mark.slow  # several launcher subprocesses: seconds
def test_save_every_and_max_restarts_reach_every_training_stage(tmp_path):
    p = run_pretrain(tmp_path, "--fullrun", "--save_every=100", "--max-restarts", "1")
    calls = torchrun_calls(parse(p.stdout)[1])
    for module in ("scripts.base_train", "scripts.mid_train", "scripts.chat_sft"):
        assert "--max-restarts=1" in calls[module][0], module
        assert calls[module][1][-2:] == ["--save_every=100", "--resume_from_step=auto"], module
    for module in ("scripts.base_loss", "scripts.base_eval", "scripts.chat_eval"):
        assert not any(a.startswith("--max-restarts") for a in calls[module][0]), module
        assert not any(a.startswith(("--save_every", "--resume_from_step")) for a in calls[module][1]), module
    # the environment's defaults, and a resume step of the user's own goes after (base_train: the last value wins)
    p = run_pretrain(tmp_path, "--resume_from_step=40", env=base_env(tmp_path, MAX_RESTARTS=7, SAVE_EVERY=-1))
    launcher, args = torchrun_calls(parse(p.stdout)[1])["scripts.base_train"]
    assert "--max-restarts=7" in launcher and args[-3:] == ["--save_every=-1", "--resume_from_step=auto",
                                                             "--resume_from_step=40"]
    assert parse(p.stdout)[0]["shutdown_timeout"] == "300"
    p = run_pretrain(tmp_path, env=base_env(tmp_path, TORCH_ELASTIC_SHUTDOWN_TIMEOUT=900))
    assert parse(p.stdout)[0]["shutdown_timeout"] == "900"
    p = run_pretrain(tmp_path, "--max_restarts=-1", check=False)
    assert p.returncode == 2 and "--max_restarts must be >= 0" in p.stderr and "RUN:" not in p.stdout


@pytest.mark.slow  # several launcher subprocesses: seconds
def test_a_wrong_flag_runs_nothing_for_real(tmp_path):
    """Not a dry run: a launcher flag with a bad value stops before the data, the report or any torchrun."""
    install_fakes(tmp_path)
    log = tmp_path / "calls.log"
    env = base_env(tmp_path, CALL_LOG=log)
    env["PATH"] = f"{tmp_path / 'bin'}:/usr/bin:/bin"
    for bad in ("--save_every=often", "--depth=21", "--nproc_per_node=0"):
        p = run_pretrain(tmp_path, bad, env=env, check=False, dry=False)
        assert p.returncode == 2 and p.stderr.startswith("error: "), (bad, p.stderr)
    assert not log.exists() and not (tmp_path / "base").exists()


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_stop_signal_to_pretrain_sh_saves_and_stops_the_pipeline(base_dir, sig):
    """A real pretrain.sh at toy size, 2 CPU ranks: the signal to the launcher (the only process a Kubernetes-style
    platform signals) reaches the ranks through torchrun (SIGUSR1 only with --signals-to-handle), they finish the
    step and save it, and the launcher stops the pipeline with status 128 + the signal, so the job is requeued."""
    from conftest import subprocess_env
    from nanochat.checkpoint.steps import latest_resumable_step

    env = subprocess_env(base_dir, PYTHON=sys.executable, TORCHRUN=f"{sys.executable} -m torch.distributed.run",
                         CUDA_VISIBLE_DEVICES="")
    steps = 2000
    args = ["--depth=2", "--num_shards=2", "--device_batch_size=4", "--nproc_per_node=2", "--prepare=0",
            "--model_tag=stopped", "--max_seq_len=64", "--total_batch_size=512", f"--num_iterations={steps}",
            "--eval_every=-1", "--core_metric_every=-1", "--sample_every=-1", "--device_type=cpu", "--save_every=5000"]
    proc = subprocess.Popen(["bash", str(PRETRAIN), *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if f"step 00003/{steps:05d}" in line:
                break
        else:
            pytest.fail("the run ended before step 3:\n" + "".join(seen[-40:]))
        proc.send_signal(sig)
        out = "".join(seen) + proc.stdout.read()
        assert proc.wait(timeout=300) == 128 + sig, out[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert f"{sig.name} received: finishing this step" in out, out[-4000:]
    stopped_at = latest_resumable_step(str(base_dir / "base_checkpoints" / "stopped"))
    assert stopped_at is not None and 3 <= stopped_at < steps, out[-4000:]
    assert f"Stopped at step {stopped_at} on a stop signal" in out
    assert f"stopped by {sig.name}" in out
    assert "scripts.base_loss" not in out and "report generate" not in out  # the pipeline stopped there


@pytest.mark.slow
@pytest.mark.dist
def test_two_launchers_meet_in_the_rendezvous_and_stop_together(base_dir):
    """Two pretrain.sh on this machine as two nodes (NNODES=2, one CPU rank each): their torchruns meet in the c10d
    rendezvous the launcher sets up (no static master), train together, and a SIGTERM to both launchers (a job being
    preempted) makes the two ranks save the same step and both launchers stop with 143."""
    from conftest import free_port, subprocess_env
    from nanochat.checkpoint.steps import latest_resumable_step

    port = free_port()
    steps = 2000
    args = ["--depth=2", "--num_shards=2", "--device_batch_size=4", "--nproc_per_node=1", "--prepare=0",
            "--model_tag=two", "--max_seq_len=64", "--total_batch_size=512", f"--num_iterations={steps}",
            "--eval_every=-1", "--core_metric_every=-1", "--sample_every=-1", "--device_type=cpu"]
    procs = []
    for rank in (1, 0):
        env = subprocess_env(base_dir, PYTHON=sys.executable, TORCHRUN=f"{sys.executable} -m torch.distributed.run",
                             CUDA_VISIBLE_DEVICES="", NNODES=2, NODE_RANK=rank, MASTER_ADDR="127.0.0.1",
                             MASTER_PORT=port, NANOCHAT_RUN_ID="two-launchers")
        procs.append(subprocess.Popen(["bash", str(PRETRAIN), *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    node1, node0 = procs
    outputs = [[], []]  # read both all along: torch's rank 0 may be on either node (the rendezvous decides)
    readers = [threading.Thread(target=lambda p=p, o=o: o.extend(p.stdout), daemon=True) for p, o in zip(procs, outputs)]
    for t in readers:
        t.start()
    try:
        deadline = time.time() + 240
        while not any(f"step 00003/{steps:05d}" in "".join(o) for o in outputs):
            if time.time() > deadline or any(p.poll() is not None for p in procs):
                pytest.fail("no training step:\n" + "".join(outputs[0][-30:]) + "".join(outputs[1][-30:]))
            time.sleep(0.5)
        for p in procs:
            p.send_signal(signal.SIGTERM)
        codes = (node0.wait(timeout=300), node1.wait(timeout=300))
        for t in readers:
            t.join(timeout=30)
        out1, out0 = ("".join(o) for o in outputs)
        assert codes == (143, 143), out0[-3000:] + out1[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert "--rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:" in out0 and "--rdzv-id=two-launchers" in out1
    stopped_at = latest_resumable_step(str(base_dir / "base_checkpoints" / "two"))
    assert stopped_at is not None and 3 <= stopped_at < steps, out0[-3000:]
    assert "stopped by SIGTERM" in out0 and "stopped by SIGTERM" in out1
