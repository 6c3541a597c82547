"""
Stopping on notice: SIGTERM or SIGUSR1 (a scheduler's preemption notice, Slurm's `--signal`, torchrun passing on the
SIGTERM it got) asks a training run to stop cleanly. The handler only records the signal; the loop asks
`stop.requested(device)` once per step, every rank finishes that step, the run saves a checkpoint and exits 0, and
the next start with `--resume_from_step=auto` continues from it as if it had not stopped.

Ranks agree: a signal may reach one rank, all of them, or all at slightly different moments (one rank already past
the check of step k, another not). So `requested` is a collective, a MAX all-reduce of the flag each step: every rank
sees the same answer at the same step and they all save the same step. (One scalar per step: the loss is all-reduced
there anyway.) A second signal while the save runs does not kill the process: the first one is already being honoured.
"""

import signal

from nanochat.common import print0
from nanochat.distributed.dist import any_rank

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignal:
    """Records SIGTERM/SIGUSR1 from install() on; `requested(device)` is the ranks' agreed answer."""

    def __init__(self):
        self.received = None  # the signal's name once one arrived
        self._previous = {}

    def install(self):
        """Handle the stop signals in this (main) thread from now on; returns self."""
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum, frame):
        if self.received is None:
            self.received = signal.Signals(signum).name
            print(f"{self.received} received: finishing this step, then saving a checkpoint and exiting", flush=True)

    def requested(self, device):
        """True on every rank once any rank has received a stop signal (a collective: every rank must call it)."""
        return any_rank(self.received is not None, device)


def report_stop(step, checkpoint_dir):
    print0(f"Stopped at step {step} on a stop signal (SIGTERM/SIGUSR1): checkpoint saved in {checkpoint_dir}; start "
           f"the same command with --resume_from_step=auto to continue")
