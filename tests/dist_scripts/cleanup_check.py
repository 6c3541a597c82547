"""
nanochat.distributed.dist.compute_cleanup really tears the gloo process groups down (tests/distributed/test_dist_train.py). A d1 GPT trains one
step under the given strategy (ddp: the DDP path, fsdp: --use_fsdp=1, tp: --tp_size=2), then the script ends as every
script does: compute_cleanup() inside main, then main returns. Rank 0 prints two JSON lines with the names of the
process's gloo threads: {"at": "cleanup", ...} right after compute_cleanup (the model still alive), and {"at": "exit",
...} from an exit hook that runs after nanochat's (atexit runs hooks last-registered first).

    torchrun --nproc_per_node=2 cleanup_check.py ddp|fsdp|tp
"""

import atexit
import json
import os
import sys

import torch

from nanochat.distributed.dist import compute_cleanup, compute_init
from nanochat.gpt import GPT, GPTConfig
from nanochat.distributed.parallel import FSDP, DataParallel, ParallelConfig, TensorParallel
from nanochat.training import train_step


def gloo_threads():
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended while we listed
            pass
    return sorted(n for n in names if "gloo" in n)


def main(strategy):
    _, rank, _, _, device = compute_init("cpu")
    parallel = {"ddp": DataParallel(), "fsdp": FSDP(), "tp": TensorParallel(ParallelConfig(tp_size=2))}[strategy]
    torch.manual_seed(0)
    model = GPT(GPTConfig(sequence_len=16, vocab_size=64, n_layer=1, n_head=2, n_kv_head=2, n_embd=32), attn="sdpa")
    model.init_weights("nanochat")
    model = parallel.wrap(model, device)
    optimizers = parallel.setup_optimizers(model)
    g = torch.Generator().manual_seed(0)  # the same rows on every rank (the tp ranks of a group must agree)
    batch = (torch.randint(0, 64, (1, 16), generator=g), torch.randint(0, 64, (1, 16), generator=g))
    train_step(model, optimizers, lambda: batch, 1, parallel=parallel)
    if rank == 0:
        atexit.register(lambda: print(json.dumps({"at": "exit", "gloo_threads": gloo_threads()}), flush=True))
    compute_cleanup()
    if rank == 0:
        print(json.dumps({"at": "cleanup", "gloo_threads": gloo_threads()}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
