"""
How an entry point ends on a mistake the user can fix: one line on stderr, a status, no traceback.

Every script's `__main__` is `run_main(main)`. Inside, code that meets a known mistake raises one of the errors
below with a message that names the flag or file and the fix:

    raise BadValue("--device_batch_size must be >= 1, got 0")         # a value or combination of flags, status 2
    raise Missing(f"no tokenizer in {tok_dir}: run python -m scripts.tok_train first")   # a file, status 2
    raise CannotRun("--device_type=cuda but torch sees no CUDA device; use --device_type=cpu")  # this machine, 2
    raise BrokenSetup("nvidia-smi lists 8 GPU(s) but torch 2.9.0+cpu cannot use them ...")  # the install, status 1
    raise RunFailure("3 shard(s) failed to download: ...")            # the work itself failed, status 1
    raise Interrupted("Stopped at step 40 on Ctrl-C: ...", signal.SIGINT)  # a stop signal (preemption.py), 128 + sig

run_main prints `error: <message>` (one line) and exits with the status. Under torchrun every rank hits the same
check (they run before any collective) and exits with the same status, but only global rank 0 prints, so the line
appears once for the job. Rank 0 also writes it to its torchrun error file, so torchrun's closing failure summary (the
last thing a cluster log shows) names it as the root cause instead of "error_file: <N/A>", without a traceback. The
other ranks give rank 0 a head start before they exit (torchrun stops every rank as soon as one exits, which could
cut rank 0 off before it prints); a mistake only one rank meets still reaches the summary through that rank's error
file (local rank 0 of each node writes one). Anything else is a bug and keeps its traceback (recorded for torchrun's
summary by torch's `record`).

The errors subclass ValueError / FileNotFoundError / RuntimeError, so library callers that catch those still do.
Standard library only: the launchers' flag checks (scripts/launch.py) run before torch is installed.
"""

import json
import os
import sys
import time


class KnownError(Exception):
    """A failure whose message says all there is to say: printed as one line, exit status `status`."""

    status = 2


class UsageError(KnownError):
    """A mistake in what the user asked for (status 2)."""


class BadValue(UsageError, ValueError):
    """A flag's value, or a combination of flags, that cannot work."""


class Missing(UsageError, FileNotFoundError):
    """A file or directory the command needs (checkpoint step, tokenizer, data, eval bundle) is not there."""


class CannotRun(UsageError, RuntimeError):
    """This machine cannot do what was asked (no CUDA device for --device_type=cuda, FP8 without Hopper...)."""


class BrokenSetup(KnownError, RuntimeError):
    """This machine's install cannot do its job (nvidia-smi lists GPUs but torch is a CPU-only build): status 1, as
    `python -m nanochat.setup_check gpu` that the launchers run."""

    status = 1


class RunFailure(KnownError, RuntimeError):
    """The work was started and failed for a known reason (a download that keeps failing): status 1."""

    status = 1


class Interrupted(BaseException):
    """
    A stop signal that ends the run where it stands (nanochat/preemption.py): Ctrl-C after the step it finished was
    saved, a second Ctrl-C, or any stop signal during start-up (loading, compiling), before training began. Its
    message is the one line (what happened, what was saved, how to continue), printed without "error: "; the status
    is 128 + the signal (130 for Ctrl-C), what shells and schedulers read as "stopped by a signal, run again". A
    BaseException, as KeyboardInterrupt: no `except Exception` on the way out may swallow it.
    """

    prefix = ""

    def __init__(self, message, signum):
        super().__init__(message)
        self.status = 128 + int(signum)


def one_line(message):
    """The message on one line: a multi-line message (a list of places looked in) is joined with spaces."""
    return " ".join(part.strip() for part in str(message).splitlines() if part.strip())


RANK0_HEAD_START_S = 5  # how long the other ranks of a torchrun job wait before exiting on a usage error


def report(error):
    """Print `error: <message>` on stderr, on global rank 0 only (every rank of a torchrun job meets the same check)."""
    if _env_int("RANK") == 0:
        print(_line(error), file=sys.stderr, flush=True)


def exit_with(error):
    """Report a KnownError and exit with its status; under torchrun, also for torchrun's failure summary."""
    report(error)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        if _env_int("RANK") != 0:
            time.sleep(RANK0_HEAD_START_S)  # rank 0 reports first; if it does, torchrun stops this rank meanwhile
        error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if error_file and _env_int("LOCAL_RANK") == 0:  # torch's ErrorHandler format: a message, no traceback
            with open(error_file, "w", encoding="utf-8") as f:
                json.dump({"message": _line(error), "timestamp": str(int(time.time()))}, f)
    sys.exit(getattr(error, "status", 2))


def _line(error):
    """`error: <message>` on one line (an Interrupted run's line has no prefix)."""
    return f"{getattr(error, 'prefix', 'error: ')}{one_line(error)}"


def _env_int(name):
    return int(os.environ.get(name, "0") or 0)


def run_main(main, argv=None):
    """
    The `__main__` of every entry point: run main(argv); a KnownError (or an Interrupted run) becomes its one line and
    exit status, an int returned is the exit status, anything else raised keeps its traceback (recorded for torchrun
    under torchrun).
    """

    def guarded():
        try:
            return main(argv)
        except (KnownError, Interrupted) as e:
            exit_with(e)

    if "TORCHELASTIC_RUN_ID" in os.environ:  # under torchrun: a bug's traceback goes into torchrun's failure summary
        from torch.distributed.elastic.multiprocessing.errors import record

        guarded = record(guarded)
    result = guarded()
    sys.exit(result if isinstance(result, int) and not isinstance(result, bool) else 0)
