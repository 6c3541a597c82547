"""
Stopping on notice: Ctrl-C (SIGINT), SIGTERM or SIGUSR1 (a scheduler's preemption notice, Slurm's `--signal`,
torchrun passing on the signal it got) asks a training run to stop cleanly. A training stage holds one StopSignal
from its start (nanochat/stage.py) and it acts in two ways:

- during start-up (loading, building, compiling: before the loop runs) there is no step to finish and nothing to save:
  the signal ends the run at once with one line and status 128 + the signal (usage.Interrupted), the status a
  launcher's requeue reads, instead of a KeyboardInterrupt traceback or a silent kill;
- once training runs (`training_started`) the handler only records the signal; the loop asks
  `stop.requested(device)` once per step, every rank finishes that step, and the run saves a checkpoint. On
  SIGTERM/SIGUSR1 it then ends as a finished run would (exit 0: the launcher that sent the notice stops the pipeline);
  on Ctrl-C it exits with 130 and one line saying where the step was saved and how to resume. A second Ctrl-C stops
  at once without saving (what a user who pressed it twice wants); a second SIGTERM/SIGUSR1 changes nothing, the first
  one is already being honoured.

Either way the next start with `--resume_from_step=auto` continues as if the run had not stopped.

Ranks agree: a signal may reach one rank, all of them, or all at slightly different moments (one rank already past
the check of step k, another not). So `requested` is a collective, a MAX all-reduce of the signal's number each step:
every rank sees the same answer (and the same signal) at the same step and they all save the same step. (One scalar
per step: the loss is all-reduced there anyway.) Under torchrun a Ctrl-C reaches torchrun, which passes SIGINT on to
the ranks: the same path.
"""

import signal

from nanochat.distributed.dist import max_over_ranks
from nanochat.usage import Interrupted

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def describe(name):
    """How a line names the signal: Ctrl-C for SIGINT."""
    return "Ctrl-C (SIGINT)" if name == "SIGINT" else name


class StopSignal:
    """Handles SIGINT/SIGTERM/SIGUSR1 from install() on: start-up mode until training_started(), then recording."""

    def __init__(self):
        self.received = None  # the signal's name once one arrived (recording mode)
        self.agreed = None  # the ranks' answer at the step that stopped: the signal's name
        self.training = False
        self._previous = {}

    def install(self):
        """Handle the stop signals in this (main) thread from now on, in start-up mode; returns self."""
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def training_started(self):
        """From now on a signal is a request to finish the step and save, recorded for `requested`."""
        self.training = True

    def uninstall(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if not self.training:
            self.uninstall()  # the run is ending: a further signal acts as it would without us
            raise Interrupted(f"Stopped by {describe(name)} during start-up, before the first training step: nothing "
                              f"was trained or saved; run the same command again to start", signum)
        if self.received is None:
            self.received = name
            again = " (Ctrl-C again stops at once, without saving)" if name == "SIGINT" else ""
            print(f"{name} received: finishing this step, then saving a checkpoint and exiting{again}", flush=True)
        elif name == "SIGINT":
            self.uninstall()
            raise Interrupted("Stopped at once by a second Ctrl-C (SIGINT), without saving the step it was on: "
                              "--resume_from_step=auto continues from the latest saved checkpoint", signum)

    def requested(self, device):
        """True on every rank once any rank has received a stop signal (a collective: every rank must call it)."""
        code = max_over_ranks(signal.Signals[self.received].value if self.received else 0, device)
        if code:
            self.agreed = signal.Signals(code).name
        return bool(code)


def stop_line(step, checkpoint_dir, name, saved, saves=True):
    """The line a stopped run ends with: the signal, the step, where it was saved and how to continue. saved: this
    step was just saved; saves: the run writes checkpoints at all (mid_train --dry_run does not)."""
    if saved:
        where = (f"checkpoint saved in {checkpoint_dir}; start the same command with --resume_from_step=auto (or "
                 f"--resume_from_step={step}) to continue")
    elif saves:
        where = "no step was trained since the start, so nothing new was saved; start the same command again to continue"
    else:
        where = "this run saves no checkpoints, so nothing was saved"
    return f"Stopped at step {step} on a stop signal ({describe(name)}): {where}"
