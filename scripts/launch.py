"""
The shell launchers' flags, parsed with the Flags every script uses (nanochat/configurator.py), so a launcher
refuses a mistake the way a script does: one line naming the flag, "Did you mean", exit status 2, and nothing run.

    python3 -m scripts.launch runcpu.sh ARGS...     -> shell assignments for the launcher to eval (DRY_RUN=0|1)
    python3 -m scripts.launch speedrun.sh ARGS...
    python3 -m scripts.launch runcpu.sh --help      -> the launcher's header comment, then its flags

scripts/lib.sh's launch_flags calls it first thing. runcpu.sh and speedrun.sh run it before a virtual environment
exists, so the module imports only the standard library and nanochat.configurator. (pretrain.sh passes flags on to
base_train, so it asks base_train itself: NANOCHAT_CHECK_FLAGS, see nanochat.configurator.parse_flags_or_exit.)
"""

import os
import sys

from nanochat.configurator import Flag, Flags, FlagError
from nanochat.usage import run_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def header(launcher):
    """The launcher's header comment (line 2 down to `set -euo pipefail`), as scripts/lib.sh's usage prints it."""
    lines = []
    with open(os.path.join(REPO, launcher), encoding="utf-8") as f:
        for i, line in enumerate(f):
            if line.startswith("set -euo pipefail"):
                break
            if i > 0:
                lines.append(line.rstrip("\n")[2:] if line.startswith("# ") else line.rstrip("\n").lstrip("#"))
    return "\n".join(lines)


def dry_run_flag(what):
    return Flag("dry_run", os.environ.get("NANOCHAT_DRY_RUN", "0") not in ("", "0"), what)


LAUNCHERS = {
    "runcpu.sh": lambda: Flags(dry_run_flag("print the setup commands it would run (venv, Rust, install), then stop"),
                               prog="bash runcpu.sh", description=header("runcpu.sh")),
    "speedrun.sh": lambda: Flags(dry_run_flag("print every command, setup included, and run none"),
                                 prog="bash speedrun.sh", description=header("speedrun.sh")),
}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in LAUNCHERS:  # --help, or a mistake: the launcher comes first
        Flags(Flag("launcher", None, "the launcher whose flags follow", type=str, choices=list(LAUNCHERS),
                   positional=True, required=True),
              dry_run_flag("every launcher's: print what it would run, run nothing (its --help says what exactly)"),
              prog="python3 -m scripts.launch", description=__doc__).parse(argv)
        raise FlagError(f"flags go after the launcher's name: python3 -m scripts.launch LAUNCHER FLAGS ({argv})")
    flags = LAUNCHERS[argv[0]]()
    config = flags.parse(argv[1:])  # --help prints the help and exits 0; a mistake raises FlagError
    print(f"DRY_RUN={int(config['dry_run'])}")
    return 0


if __name__ == "__main__":
    run_main(main)
