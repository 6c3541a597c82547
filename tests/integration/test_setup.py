"""
Fresh-machine setup (nanochat/setup_check.py, nanochat/launch/bootstrap.py): runcpu.sh and speedrun.sh decide
"installed?" from the installed distribution, bootstrap Rust and the venv when missing, and a GPU launcher refuses to
train on the CPU.

Real interpreters: an empty venv (created here, no pip: a second) and this test's own complete one. The GPU is a
stand-in `nvidia-smi` on PATH; the setup commands are checked through the scripts' dry-run mode.
"""

import os
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
COMPLETE_VENV = Path(sys.executable).parents[1]


def make_exe(path, body):
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def link_python3(bin_dir):
    """A python3 on a PATH of stand-ins: the launchers' setup runs on it (standard library only)."""
    (bin_dir / "python3").symlink_to(os.path.realpath(sys.executable))


def clean_env(tmp_path, **extra):
    """No PYTHONPATH (the question is what the venv itself has), a HOME without ~/.cargo, and none of the caller's
    NANOCHAT_* settings (CI exports NANOCHAT_INSTALL_CHROMIUM=1 and NANOCHAT_VENV; each test states its own)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "CUDA_VISIBLE_DEVICES") and not k.startswith("NANOCHAT_")}
    env["HOME"] = str(tmp_path / "home")
    # a rustup-managed cargo on PATH finds its toolchains through RUSTUP_HOME (default ~/.rustup): keep the real one, or
    # the changed HOME would make the caller's cargo a proxy without a toolchain (which the launchers refuse)
    rustup_home = os.environ.get("RUSTUP_HOME") or os.path.expanduser("~/.rustup")
    if os.path.isdir(rustup_home):
        env["RUSTUP_HOME"] = rustup_home
    env.update({k: str(v) for k, v in extra.items()})
    return env


@pytest.fixture(scope="module")
def empty_venv(tmp_path_factory):
    path = tmp_path_factory.mktemp("venv") / "empty"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    return path


def check(python, *args, env):
    return subprocess.run([str(python), "-m", "nanochat.setup_check", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # imports torch in subprocesses
def test_installed_is_read_from_the_distribution_not_the_source_tree(tmp_path, empty_venv):
    env = clean_env(tmp_path)
    # the trap the old check fell into: from the repo root both "import" with nothing installed
    old = subprocess.run([str(empty_venv / "bin" / "python"), "-c", "import rustbpe, nanochat"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert old.returncode == 0
    p = check(empty_venv / "bin" / "python", "installed", env=env)
    assert p.returncode == 1
    assert "the nanochat distribution is not installed" in p.stderr
    assert "torch does not import" in p.stderr
    assert "rustbpe is only the source directory" in p.stderr
    # the complete venv (the one running this test) passes, dev extras included
    p = check(sys.executable, "installed", "--extras", "dev", env=env)
    assert p.returncode == 0, p.stderr
    assert f"nanochat is installed in {COMPLETE_VENV}" in p.stdout


def test_a_dependency_missing_from_the_install_makes_it_incomplete():
    from nanochat import setup_check

    assert setup_check._requirement('pytest>=8 ; extra == "dev"') == ("pytest", ">=8", "dev")
    assert setup_check._requirement("torch>=2.9") == ("torch", ">=2.9", None)
    assert setup_check.install_problems() == []

    reqs = ["a-package-that-is-not-installed>=1", 'pytest>=1000; extra == "dev"', "pytest>=1"]
    assert setup_check.requirement_problems(reqs) == ["dependency a-package-that-is-not-installed is not installed"]
    problems = setup_check.requirement_problems(reqs, ("dev",))
    assert any(p.startswith("dependency pytest ") and p.endswith("does not satisfy >=1000") for p in problems)


@pytest.mark.slow  # imports torch in a subprocess per script (~10 s each on a busy 2-core box)
@pytest.mark.parametrize("script", ["runcpu.sh", "speedrun.sh"])
def test_launchers_install_only_when_the_venv_lacks_nanochat(tmp_path, empty_venv, script):
    env = clean_env(tmp_path, NANOCHAT_DRY_RUN=1, NANOCHAT_BASE_DIR=tmp_path / "base")
    env["NANOCHAT_VENV"] = str(empty_venv)
    p = subprocess.run(["bash", str(REPO / script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"RUN: {empty_venv}/bin/python -m pip install -q -e ." in p.stdout
    env["NANOCHAT_VENV"] = str(COMPLETE_VENV)
    p = subprocess.run(["bash", str(REPO / script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "pip install" not in p.stdout and "nanochat is installed" in p.stdout
    assert not (tmp_path / "base").exists()  # a dry run leaves the disk alone


def test_no_cargo_installs_rust_with_rustup_and_says_so(tmp_path):
    if shutil.which("cargo", path="/usr/bin:/bin"):
        pytest.skip("cargo is installed system-wide: no PATH without it")
    env = clean_env(tmp_path, NANOCHAT_DRY_RUN=1, NANOCHAT_VENV=tmp_path / "fresh-venv", PATH="/usr/bin:/bin")
    p = subprocess.run(["bash", str(REPO / "speedrun.sh")], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    assert "cargo not found: installing Rust with rustup" in out
    assert "RUN: curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y" in out
    # order: venv, Rust, install, GPU check, then training
    steps = ["-m venv", "sh.rustup.rs", "pip install -q -e .", "setup_check gpu", "scripts.base_train"]
    assert [out.index(s) for s in steps] == sorted(out.index(s) for s in steps)
    assert not (tmp_path / "fresh-venv").exists() and not (tmp_path / "home" / ".cargo").exists()


def test_cargo_that_does_not_run_is_named_with_the_fix(tmp_path):
    """A rustup proxy with no default toolchain is on PATH but cannot build rustbpe (seen on a machine whose HOME had
    no ~/.rustup): tests/run.sh and speedrun.sh stop before pip with the reason and `rustup default stable`; speedrun
    does not reinstall Rust over it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    make_exe(bin_dir / "cargo", 'echo "error: rustup could not choose a version of cargo to run" >&2; exit 1\n')
    for tool in ("bash", "dirname"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    link_python3(bin_dir)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    make_exe(venv / "bin" / "python", "exit 0\n")
    env = clean_env(tmp_path, NANOCHAT_VENV=venv, PATH=str(bin_dir))
    p = subprocess.run(["bash", str(REPO / "tests" / "run.sh")], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "does not run" in p.stderr and "rustup could not choose" in p.stderr and "rustup default stable" in p.stderr
    assert "installing nanochat" not in p.stdout + p.stderr


def test_missing_venv_module_falls_back_or_names_the_package(tmp_path):
    """python3 without a working venv module and no uv/pip: one line naming the apt package."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # a python3 whose venv fails like Ubuntu's without python3.X-venv, and that has no pip
    make_exe(bin_dir / "python3", 'case "$*" in\n'
             '  "-m venv"*) echo "The virtual environment was not created successfully because ensurepip is not '
             'available." >&2; exit 1 ;;\n'
             '  "-m pip"*) exit 1 ;;\n'
             f'  *) exec {sys.executable} "$@" ;;\nesac\n')
    env = clean_env(tmp_path, PATH=f"{bin_dir}:/usr/bin:/bin")
    p = subprocess.run(["python3", "-m", "nanochat.launch.bootstrap", "venv", f"{tmp_path}/v"], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    if shutil.which("uv", path="/usr/bin:/bin"):
        pytest.skip("uv is installed system-wide")
    assert p.returncode != 0
    minor = sys.version_info.minor
    assert f"sudo apt-get install python3.{minor}-venv" in p.stderr and "uv" in p.stderr


def test_missing_venv_module_falls_back_to_uv(tmp_path):
    """python3's venv fails (Ubuntu without python3.X-venv), pip works: uv is installed from PyPI and makes the venv."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    home = tmp_path / "home"
    # pip "installs" uv where `pip install --user` puts it; that uv records its arguments and makes a venv
    uv_body = f'echo "uv $*" >> {log}\nmkdir -p "${{@: -1}}/bin" && ln -s {sys.executable} "${{@: -1}}/bin/python"\n'
    make_exe(bin_dir / "python3", 'case "$*" in\n'
             '  "-m venv"*) mkdir -p "${@: -1}"; exit 1 ;;\n'  # leaves a half-made venv behind, as the real one does
             f'  "-m pip --version") exit 0 ;;\n'
             f'  "-m pip install"*) echo "pip $*" >> {log}; mkdir -p {home}/.local/bin; '
             f'printf "%s\\n" "#!/usr/bin/env bash" {shlex.quote(uv_body)} > {home}/.local/bin/uv; '
             f'chmod +x {home}/.local/bin/uv ;;\n'
             f'  *) exec {sys.executable} "$@" ;;\nesac\n')
    env = clean_env(tmp_path, PATH=f"{bin_dir}:/usr/bin:/bin")
    if shutil.which("uv", path=env["PATH"]):
        pytest.skip("uv is installed system-wide")
    p = subprocess.run(["python3", "-m", "nanochat.launch.bootstrap", "venv", f"{tmp_path}/v"], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "trying uv instead" in p.stdout
    calls = log.read_text().splitlines()
    assert calls[0] == "pip -m pip install --user --quiet uv"
    assert calls[1] == f"uv venv --seed --python {bin_dir}/python3 {tmp_path}/v"
    assert (tmp_path / "v" / "bin" / "python").exists()


@pytest.mark.slow  # imports torch in subprocesses
def test_gpu_check_with_a_stand_in_nvidia_smi(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a usable GPU")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    env = clean_env(tmp_path, PATH=f"{bin_dir}:/usr/bin:/bin")
    # no nvidia-smi at all: not a GPU node
    p = check(sys.executable, "gpu", env=env)
    assert p.returncode == 1 and "no NVIDIA GPU found" in p.stderr and "runcpu.sh" in p.stderr
    # nvidia-smi lists 8 GPUs but torch cannot use them: stop, naming the build, its CUDA and the fix
    lines = "".join(f'echo "GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})"\n' for i in range(8))
    make_exe(bin_dir / "nvidia-smi", f'if [ "$1" = "-L" ]; then\n{lines}else echo 535.104.05; fi\n')
    p = check(sys.executable, "gpu", env=env)
    assert p.returncode == 1
    assert "nvidia-smi lists 8 GPU(s)" in p.stderr and "train" in p.stderr
    assert f"torch {torch.__version__}" in p.stderr
    if torch.version.cuda:
        assert f"built for CUDA {torch.version.cuda}" in p.stderr and "535.104.05" in p.stderr
    else:
        assert "CPU-only wheel" in p.stderr
    assert "pip install --force-reinstall torch --index-url https://download.pytorch.org/whl/cu" in p.stderr


@pytest.mark.slow  # two torch imports in subprocesses
def test_speedrun_stops_before_training_when_torch_cannot_use_the_gpus(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a usable GPU")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    make_exe(bin_dir / "nvidia-smi", 'if [ "$1" = "-L" ]; then echo "GPU 0: NVIDIA H100"; else echo 535.104.05; fi\n')
    env = clean_env(tmp_path, PATH=f"{bin_dir}:/usr/bin:/bin", NANOCHAT_VENV=COMPLETE_VENV,
                    NANOCHAT_BASE_DIR=tmp_path / "base")
    p = subprocess.run(["bash", str(REPO / "speedrun.sh")], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 1 and f"torch {torch.__version__}" in p.stderr
    assert "RUN:" not in p.stdout and not (tmp_path / "base").exists()


def test_tests_run_sh_passes_arguments_to_pytest_and_installs_chromium_only_when_asked(tmp_path):
    """tests/run.sh against a stand-in venv python, cargo and apt-get that log their calls; PATH holds only those
    and the three tools the script needs, so a chromium installed on this machine is out of sight."""
    log = tmp_path / "calls.log"
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    make_exe(venv / "bin" / "python", f'for a in "$@"; do printf "[%s]" "$a"; done >> {log}; echo >> {log}\n')
    make_exe(bin_dir / "cargo", "exit 0\n")
    make_exe(bin_dir / "apt-get", f'echo "apt-get $*" >> {log}\n')
    make_exe(bin_dir / "id", 'echo 0\n')  # as root, where an install could happen
    for tool in ("bash", "dirname"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    link_python3(bin_dir)
    env = clean_env(tmp_path, NANOCHAT_VENV=venv, PATH=str(bin_dir))
    p = subprocess.run(["bash", str(REPO / "tests" / "run.sh"), "-m", "not slow and not dist", "-x"], env=env,
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    calls = log.read_text().splitlines()
    assert calls[-1] == "[-m][pytest][-q][-n][2][--dist][loadfile][--no-loadscope-reorder][-m][not slow and not dist][-x]"  # two workers
    assert "[-m][pip][install][-q][-e][.[dev]]" in calls
    log.unlink()
    env["NANOCHAT_TEST_WORKERS"] = "0"  # one process, for pdb and -s
    p = subprocess.run(["bash", str(REPO / "tests" / "run.sh"), "-x"], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and log.read_text().splitlines()[-1] == "[-m][pytest][-q][-x]", p.stdout + p.stderr
    del env["NANOCHAT_TEST_WORKERS"]
    assert not any(c.startswith("apt-get") for c in calls)  # nothing outside the venv changed unasked
    assert "NANOCHAT_INSTALL_CHROMIUM=1" in p.stdout
    log.unlink()
    env["NANOCHAT_INSTALL_CHROMIUM"] = "1"
    p = subprocess.run(["bash", str(REPO / "tests" / "run.sh")], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    calls = log.read_text().splitlines()
    assert calls[2:4] == ["apt-get update -qq", "apt-get install -y -qq chromium"]
    assert "installing chromium" in p.stdout and "RUN: apt-get update" in p.stdout
