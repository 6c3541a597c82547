#!/usr/bin/env bash
# pretrain.sh: launch nanochat training on one node or many, building the torchrun command itself.
#
#   bash pretrain.sh [--depth=20] [--posttrain | --fullrun] [--dry_run] [overrides] [base_train flags]
#
# Where it runs (picked from the environment, first match wins; NANOCHAT_LAUNCHER=volcengine|slurm|torchrun|single
# forces one, e.g. inside an `salloc` shell whose SLURM_* variables describe nodes you are not launching on):
#   volcengine  MLP_WORKER_NUM, MLP_ROLE_INDEX, MLP_WORKER_0_HOST, MLP_WORKER_0_PORT, MLP_WORKER_GPU
#   slurm       SLURM_NNODES, SLURM_NODEID, master = first host of SLURM_STEP_NODELIST or SLURM_JOB_NODELIST,
#               port = MASTER_PORT or 20000 + SLURM_JOB_ID % 10000; run once per node (srun --ntasks-per-node=1)
#   torchrun    NNODES>1, NODE_RANK, MASTER_ADDR, MASTER_PORT (default 29500): plain launchers started by hand
#   single      torchrun --standalone, one process per visible GPU (1 process on CPU)
# More than one node with the same value of everything above runs one job across them.
#
# Modes: pretrain (default): [data + tokenizer] -> base_train -> base_loss -> base_eval
#        --posttrain: mid_train -> chat_eval -i mid -> chat_sft -> chat_eval -i sft
#        --fullrun:   both
# Flags (--a_b=v, --a-b v, --a_b v all work):
#   --depth=N               preset: 20 22 26 32 40 44 48 56 64 (default 20, or $MODEL_DEPTH); the table is
#                           nanochat/presets.py (`python -m nanochat.presets --format markdown` prints it)
#   --num_shards=N          data shards to download (preset value by default)
#   --device_batch_size=N   per-GPU batch (preset value by default)
#   --use_fsdp=0|1          FSDP2 instead of DDP (on by default from d40)
#   --activation_checkpointing=none|full|selective   recompute block activations in the backward (preset: none at
#                           every depth); with --ac_every=K for selective. Passed to base_train, mid_train, chat_sft
#   --tp_size=N             tensor parallelism over N GPUs of a node (preset: 1); passed on only when N > 1
#   --model_tag=TAG         checkpoint tag (default: base_train's d{depth}); passed to every stage
#   --run=NAME              wandb run name (default $WANDB_RUN or "dummy" = wandb off)
#   --nproc_per_node=N      processes per node (default: see above; or $NPROC_PER_NODE)
#   --prepare=0             skip the data download and tokenizer step (data already in place, e.g. imported offline)
#   --recipe=december|record  training recipe (default december); another one is passed to base_train as --recipe
#   --save_every=N          every training stage saves a checkpoint every N steps (default 500, or $SAVE_EVERY;
#                           -1: the final step only) and starts with --resume_from_step=auto: from its latest
#                           complete checkpoint, fresh when there is none (another --model_tag starts over)
#   --max_restarts=N        torchrun restarts a crashed training stage up to N times (default 3, or $MAX_RESTARTS)
#   --dry_run               print the resolved settings and the commands, run nothing
#   any other --flag=value  passed through to scripts.base_train
# Preemption: SIGTERM or SIGUSR1 to this launcher (Slurm's --signal, a platform stopping the container) goes on to
# the running torchrun and its ranks: a training stage finishes its step, saves and exits; the pipeline stops with
# status 128 + the signal, so the job can be requeued, and the same command resumes. Several nodes meet in torchrun's
# c10d rendezvous on the master address (a restart brings every node back); auto resume on several nodes needs the
# checkpoints on storage every node reads (NANOCHAT_SHARED_FS=1). docs/multinode.md, "Preemptible jobs".
# With GPUs visible every stage gets --device_type=cuda, after a check that torch can really use them
# (python -m nanochat.setup_check gpu): a GPU node never trains on the CPU by accident.
# Settings by environment:
#   NANOCHAT_BASE_DIR       data, tokenizer, checkpoints, report (default ~/.cache/nanochat)
#   NANOCHAT_SHARED_FS=1    (default) on several nodes the base dir is one shared filesystem: node 0 downloads the
#                           data and trains the tokenizer, the other nodes wait for its marker file. Set 0 when the
#                           base dir is local to each node: every node then prepares its own copy.
#   NANOCHAT_PREP_TIMEOUT   seconds the other nodes wait for node 0's preparation (default 14400)
#   NANOCHAT_PREP_POLL      seconds between checks for the marker (default 10)
#   NANOCHAT_MAX_SHARDS     shards the dataset has (default 1823, FineWeb-Edu-100B); larger requests are capped
#   NANOCHAT_RUN_ID         names the marker and the rendezvous; defaults to SLURM_JOB_ID / MLP_TASK_ID / master
#                           address and port
#   TOK_MAX_CHARS           characters the tokenizer trains on (default 2000000000, as nanochat's speedrun)
#   PYTHON, TORCHRUN        interpreter and launcher (default: python, torchrun or python -m torch.distributed.run)
set -euo pipefail
# The launcher itself is Python (scripts/launch.py reads the flags and the environment; nanochat/launch/ finds the
# node's place in the job, builds the steps, its pretrain profile, and runs them), run by the interpreter that runs
# the stages ($PYTHON, else python, else python3). `exec`: it is the process that gets the scheduler's signals and
# passes them on.
REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ -n "${PYTHON:-}" ]]; then
    read -r -a PY <<<"$PYTHON"
elif command -v python >/dev/null 2>&1; then
    PY=(python)
else
    PY=(python3)
fi
export PYTHONPATH="$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}"
exec "${PY[@]}" -m scripts.launch run pretrain.sh "$@"
