"""
scripts.base_train with a planned kill -9, for the chaos test (tests/distributed/test_resume_dist.py). Run by torchrun in place
of `-m scripts.base_train`, with base_train's flags. CHAOS_PLAN (JSON) maps torchrun's restart count (the "life" of
the job, TORCHELASTIC_RESTART_COUNT) to what kills this life:

    {"0": {"rank": 1, "at": "step", "n": 2, "delay": 0.013}, "1": {"rank": 0, "at": "save", "n": 1}, ...}

- at "step": rank `rank` sends itself SIGKILL `delay` seconds into its n-th optimisation step of this life (a timer
  thread, so the kill lands wherever the process happens to be: mid forward, mid all-reduce, between steps).
- at "save": rank `rank` is killed while writing a checkpoint file of its n-th save of this life: half of the file
  is on disk as the temp file (the atomic write's rename never happens), the other ranks wait at the barrier.

SIGKILL cannot be caught: the process disappears as under `kill -9` from outside, without cleanup or handlers.
A life with no entry runs to the end.
"""

import json
import os
import signal
import sys
import threading


def main():
    life = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    plan = json.loads(os.environ.get("CHAOS_PLAN", "{}")).get(life)
    rank = int(os.environ.get("RANK", "0"))
    if plan is not None and plan["rank"] == rank:
        print(f"chaos: life {life}: rank {rank} will be killed at {plan}", flush=True)
        if plan["at"] == "step":
            from nanochat import training

            real_step, calls = training.train_step, [0]

            def train_step(*args, **kwargs):
                calls[0] += 1
                if calls[0] == plan["n"]:
                    threading.Timer(plan["delay"], os.kill, (os.getpid(), signal.SIGKILL)).start()
                return real_step(*args, **kwargs)

            from nanochat import stage

            stage.train_step = train_step  # base_train's loop steps through Stage.timed_step, which calls this name
        elif plan["at"] == "save":
            from nanochat import checkpoint_manager
            from nanochat.atomic import atomic_write

            real_save, saves = checkpoint_manager.atomic_torch_save, [0]

            def atomic_torch_save(obj, path):
                saves[0] += 1
                if saves[0] < plan["n"]:
                    return real_save(obj, path)

                def half_then_die(f):
                    import io

                    import torch

                    buf = io.BytesIO()
                    torch.save(obj, buf)
                    f.write(buf.getvalue()[: buf.tell() // 2])
                    f.flush()
                    print(f"chaos: rank {rank} killed while writing {path}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)

                atomic_write(path, half_then_die)

            checkpoint_manager.atomic_torch_save = atomic_torch_save
    from scripts.base_train import main as base_train_main

    base_train_main(sys.argv[1:])


if __name__ == "__main__":
    main()
