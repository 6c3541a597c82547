"""
A fresh machine, made ready to run nanochat: a virtual environment, Rust (maturin builds the rustbpe extension with
cargo), and `pip install -e .`. Each step checks first and says what it does; in a dry run the checks still run (they
change nothing) and the actions are only printed. runcpu.sh and speedrun.sh run it as their setup step (the launch
pipeline, nanochat/launch/pipeline.py); tests/run.sh runs it as a command:

    python3 -m nanochat.launch.bootstrap venv DIR                           the venv only
    python3 -m nanochat.launch.bootstrap install DIR --extras=dev --reinstall --install_rust=0

Standard library only, run by the system's python3: nothing is installed yet when it runs. "Installed?" is decided
from the installed distribution (python -m nanochat.setup_check installed), never from what happens to import from
the repository root (there `import nanochat, rustbpe` works with nothing installed).
"""

import os
import shutil
import subprocess
import sys

from nanochat.launch.runner import Runner, log
from nanochat.usage import CannotRun

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUSTUP = "curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y"


def _ok(argv, env):
    return subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


def ensure_venv(runner, venv):
    """A virtual environment with pip at `venv`. Ubuntu ships python3 without the venv module (package
    python3.X-venv): then uv (https://docs.astral.sh/uv/) makes it, installed from PyPI with pip if needed."""
    if os.access(os.path.join(venv, "bin", "python"), os.X_OK):
        return
    log(runner.name, f"creating the virtual environment {venv}")
    env, dry = runner.env, runner.dry_run
    if dry and _ok(["python3", "-c", "import ensurepip, venv"], env):
        runner.call(["python3", "-m", "venv", venv])
        return
    if not dry and subprocess.run(["python3", "-m", "venv", venv], env=env, stderr=subprocess.DEVNULL).returncode == 0:
        return
    if not dry:
        shutil.rmtree(venv, ignore_errors=True)  # a failed `python3 -m venv` leaves a venv without pip behind
    pkg = f"python3.{sys.version_info.minor}-venv"
    log(runner.name, f"python3 -m venv does not work here (Debian/Ubuntu: the {pkg} package is missing); trying uv instead")
    python3 = shutil.which("python3", path=env.get("PATH")) or "python3"
    local_uv = os.path.join(os.path.expanduser("~"), ".local", "bin", "uv")
    pip_uv = ["python3", "-m", "pip", "install", "--user", "--quiet", "uv"]
    if dry:
        if not shutil.which("uv", path=env.get("PATH")):
            runner.call(pip_uv)
        runner.call(["uv", "venv", "--seed", "--python", python3, venv])
        return
    uv = shutil.which("uv", path=env.get("PATH")) or (local_uv if os.access(local_uv, os.X_OK) else None)
    if uv is None and _ok(["python3", "-m", "pip", "--version"], env):
        if runner.call(pip_uv):
            runner.call([*pip_uv, "--break-system-packages"])
        uv = local_uv if os.access(local_uv, os.X_OK) else None
    if uv is None:
        raise CannotRun(f"cannot create a virtual environment: install {pkg} (sudo apt-get install {pkg}) or uv "
                        f"(https://docs.astral.sh/uv/), then run again")
    # --seed puts pip into the venv: the rest of the setup runs `python -m pip`
    runner.run([uv, "venv", "--seed", "--python", python3, venv])


def cargo_problem(env):
    """None when a cargo runs (on PATH, or in ~/.cargo/bin, which is then put on env's PATH), else what is wrong and
    the fix. A rustup proxy with no default toolchain is on PATH but cannot build anything: that is not a cargo."""
    cargo = shutil.which("cargo", path=env.get("PATH"))
    home_cargo = os.path.join(os.path.expanduser("~"), ".cargo", "bin")
    if cargo is None and os.access(os.path.join(home_cargo, "cargo"), os.X_OK):
        env["PATH"] = home_cargo + os.pathsep + env.get("PATH", "")
        cargo = os.path.join(home_cargo, "cargo")
    if cargo is None:
        return "cargo not found: install Rust (https://rustup.rs, or: curl https://sh.rustup.rs -sSf | sh -s -- -y)"
    p = subprocess.run([cargo, "--version"], env=env, capture_output=True, text=True)
    if p.returncode == 0:
        return None
    said = (p.stderr.strip() or p.stdout.strip() or "no output").splitlines()[0]
    return (f"cargo is on PATH ({cargo}) but does not run ('cargo --version' fails: {said}); with rustup, "
            f"'rustup default stable' sets a toolchain")


def ensure_rust(runner, install=True):
    """cargo on the commands' PATH; without one, Rust installed with rustup (as nanochat's speedrun does) when
    `install`, else a usage error naming the fix. A cargo that is there but does not run is never installed over."""
    problem = cargo_problem(runner.env)
    if problem is None:
        return
    if not install or shutil.which("cargo", path=runner.env.get("PATH")):
        raise CannotRun(f"{problem} to build the rustbpe tokenizer")
    log(runner.name, "cargo not found: installing Rust with rustup into $HOME/.cargo (needed to build the rustbpe "
                 "tokenizer)")
    runner.run(["bash", "-c", RUSTUP], shown=RUSTUP)
    runner.env["PATH"] = os.path.join(os.path.expanduser("~"), ".cargo", "bin") + os.pathsep + runner.env["PATH"]


def ensure_installed(runner, venv, extras=(), reinstall=False, install_rust=True):
    """nanochat (with `extras`) installed into the venv's python: checked first (python -m nanochat.setup_check
    installed), installed with `pip install -e .` when it is not, or always with `reinstall` (tests/run.sh: the
    editable install picks up a changed pyproject.toml or Rust source)."""
    py = os.path.join(venv, "bin", "python")
    check = [py, "-m", "nanochat.setup_check", "installed", *(["--extras", ",".join(extras)] if extras else [])]
    if not reinstall and os.access(py, os.X_OK) and subprocess.run(check, env=runner.env, cwd=REPO).returncode == 0:
        return
    ensure_rust(runner, install_rust)
    target = "." + (f"[{','.join(extras)}]" if extras else "")
    log(runner.name, f"installing nanochat{target[1:]} into {venv} (pip install -e {target}; builds the rustbpe extension)")
    runner.run([py, "-m", "pip", "install", "-q", "--upgrade", "pip"], cwd=REPO)
    runner.run([py, "-m", "pip", "install", "-q", "-e", target], cwd=REPO)
    if runner.dry_run or reinstall:
        return
    if subprocess.run(check, env=runner.env, cwd=REPO, stdout=subprocess.DEVNULL).returncode:
        raise CannotRun("the install finished but nanochat is still not usable (see above)")


def setup(runner, venv):
    """What runcpu.sh and speedrun.sh do first: the venv, then nanochat in it (Rust installed if need be)."""
    ensure_venv(runner, venv)
    ensure_installed(runner, venv)


def main(argv=None):
    from nanochat.configurator import Flag, Flags

    flags = Flags(
        Flag("what", None, "venv: the virtual environment only; install: it and nanochat in it", type=str,
             choices=["venv", "install"], positional=True, required=True),
        Flag("venv", None, "the virtual environment's directory", type=str, positional=True, required=True),
        Flag("extras", "", "optional dependencies to install with nanochat (dev: the test suite's)"),
        Flag("reinstall", False, "run `pip install -e .` even when nanochat is installed"),
        Flag("install_rust", True, "install Rust with rustup when there is no cargo (0: name the fix and stop)"),
        Flag("tag", "setup", "the name that prefixes the log lines"),
        Flag("dry_run", False, "print what it would run, run nothing"),
        prog="python3 -m nanochat.launch.bootstrap", description=__doc__)
    cfg = flags.parse(argv)
    runner = Runner(cfg.tag, cfg.dry_run)
    ensure_venv(runner, cfg.venv)
    if cfg.what == "install":
        ensure_installed(runner, cfg.venv, [e for e in cfg.extras.split(",") if e], cfg.reinstall, cfg.install_rust)
    return 0


if __name__ == "__main__":
    from nanochat.usage import run_main

    run_main(main)
