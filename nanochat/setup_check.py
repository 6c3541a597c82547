"""
Is this machine ready to run nanochat? The questions the launch scripts ask before doing anything, answered here
once so that runcpu.sh, speedrun.sh and pretrain.sh agree and a test can ask them too:

    python -m nanochat.setup_check installed [--extras dev]
        exit 0 when this interpreter has the nanochat distribution installed with all its dependencies, torch
        imports, and rustbpe is the compiled extension; otherwise exit 1 and list what is missing.
    python -m nanochat.setup_check gpu
        exit 0 when torch can use the GPUs; otherwise exit 1 naming the torch build, its CUDA version and the fix.
        This is what keeps a GPU launcher from training on the CPU by accident (a CPU-only wheel, or a wheel built
        for a newer CUDA than the driver supports, makes torch.cuda.is_available() False on a GPU node). The
        scripts' device autodetection (nanochat.distributed.dist.autodetect_device_type) asks the same.

And, as functions: `quick_install_problem` (pretrain.sh's check of its interpreter, without importing torch) and
`wandb_problem` (--run=NAME needs a wandb login: the training scripts' start-up check, pretrain.sh's too).

"Installed" is read from the installed distribution's metadata, never from what happens to be importable: from the
repository root `import nanochat` finds the source directory and `import rustbpe` finds the Rust crate directory
(an empty namespace package) with nothing installed at all.

Only the standard library is imported at the top: on a fresh machine this runs before torch exists.
"""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import warnings
from importlib import metadata
from pathlib import Path

from nanochat.usage import report, run_main

DIST = "nanochat"
REPO = Path(__file__).resolve().parents[1]

# -----------------------------------------------------------------------------
# installed?


def _requirement(req):
    """'torch>=2.9' / 'pytest>=8; extra == "dev"' -> (name, specifier text, extra or None)."""
    req, _, marker = req.partition(";")
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(.*)", req)
    extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", marker)
    return m.group(1), m.group(2).strip(), extra.group(1) if extra else None


def _version_ok(installed, spec):
    """True unless `packaging` is available and says the installed version is outside the specifier."""
    if not spec:
        return True
    try:
        from packaging.specifiers import SpecifierSet
    except ImportError:  # a bare venv has no packaging: presence is what we can check
        return True
    return SpecifierSet(spec).contains(installed, prereleases=True)


def _wanted_requirements(dist, extras):
    """The installed metadata's requirements, plus pyproject.toml's when this runs from a checkout: a dependency
    added to the project since the last install makes the install stale."""
    reqs = list(dist.requires or [])
    pyproject = REPO / "pyproject.toml"
    if pyproject.is_file():
        try:
            import tomllib
        except ImportError:  # Python 3.10: the installed metadata alone
            tomllib = None
        if tomllib is not None:
            project = tomllib.loads(pyproject.read_text()).get("project", {})
            reqs += project.get("dependencies", [])
            for extra in extras:
                reqs += [f'{r}; extra == "{extra}"' for r in project.get("optional-dependencies", {}).get(extra, [])]
    return reqs


def requirement_problems(requirements, extras=()):
    """The requirements (PEP 508 strings) not met by what is installed; those of other extras are skipped."""
    problems, seen = [], set()
    for req in requirements:
        name, spec, extra = _requirement(req)
        if (extra is not None and extra not in extras) or (name.lower(), spec) in seen:
            continue
        seen.add((name.lower(), spec))
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            problems.append(f"dependency {name} is not installed")
            continue
        if not _version_ok(version, spec):
            problems.append(f"dependency {name} {version} does not satisfy {spec}")
    return problems


def install_problems(extras=()):
    """Why this interpreter cannot run nanochat yet, as a list of sentences (empty: it can)."""
    problems = []
    try:
        dist = metadata.distribution(DIST)
    except metadata.PackageNotFoundError:
        problems.append(f"the {DIST} distribution is not installed in {sys.prefix}")
        dist = None
    if dist is not None:
        problems += requirement_problems(_wanted_requirements(dist, extras), extras)
    try:
        import torch  # noqa: F401  (a broken wheel fails here, not at find_spec)
    except Exception as e:  # ImportError, or an OSError from a missing shared library
        problems.append(f"torch does not import ({type(e).__name__}: {e})")
    spec = importlib.util.find_spec("rustbpe")
    if spec is None:
        problems.append("rustbpe (the compiled tokenizer extension) is not installed")
    elif spec.origin is None:
        problems.append("rustbpe is only the source directory (a namespace package), not the compiled extension")
    else:
        try:
            import rustbpe
            rustbpe.Tokenizer  # noqa: B018  (the class the extension defines)
        except Exception as e:
            problems.append(f"rustbpe does not load as the compiled extension ({type(e).__name__}: {e})")
    return problems


def quick_install_problem():
    """The first reason this interpreter cannot run nanochat that shows without importing anything (what a launcher
    asks on every start, in milliseconds): torch, the nanochat distribution, the compiled rustbpe. None when all are
    there (install_problems checks them fully)."""
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    try:
        metadata.distribution(DIST)
    except metadata.PackageNotFoundError:
        return f"the {DIST} distribution is not installed"
    spec = importlib.util.find_spec("rustbpe")
    if spec is None or spec.origin is None:
        return "rustbpe (the compiled tokenizer extension) is not installed"
    return None


# -----------------------------------------------------------------------------
# wandb login?


def wandb_login_problem(env=None):
    """Why wandb.init would have no credentials here, as a sentence, or None. Read the way wandb reads them, without
    importing it or going online: WANDB_API_KEY / WANDB_IDENTITY_TOKEN_FILE, the netrc entry for the wandb host
    (what `wandb login` writes), an api_key in wandb's settings files; WANDB_MODE=offline|disabled needs none."""
    import netrc
    from urllib.parse import urlsplit

    env = os.environ if env is None else env
    if (env.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun")
            or env.get("WANDB_DISABLED", "").lower() in ("1", "true")):
        return None
    if env.get("WANDB_API_KEY") or env.get("WANDB_IDENTITY_TOKEN_FILE"):
        return None
    host = urlsplit(env.get("WANDB_BASE_URL") or "https://api.wandb.ai").netloc
    home = os.path.expanduser("~")
    netrc_path = env.get("NETRC") or next((p for p in (os.path.join(home, ".netrc"), os.path.join(home, "_netrc"))
                                           if os.path.exists(p)), os.path.join(home, ".netrc"))
    try:
        if netrc.netrc(netrc_path).authenticators(host):
            return None
    except (OSError, netrc.NetrcParseError):
        pass
    config_dir = (env.get("WANDB_CONFIG_DIR")
                  or os.path.join(env.get("XDG_CONFIG_HOME") or os.path.join(home, ".config"), "wandb"))
    for settings in (os.path.join(config_dir, "settings"), os.path.join(env.get("WANDB_DIR") or ".", "wandb", "settings")):
        try:
            with open(settings, encoding="utf-8") as f:
                if any(line.split("=")[0].strip() == "api_key" for line in f):
                    return None
        except OSError:
            pass
    return f"no wandb login found (no WANDB_API_KEY, no {host} entry in {netrc_path})"


def wandb_problem(run_name, env=None):
    """The refusal of --run=NAME (a wandb run) without a wandb login, naming the three ways on, or None (also for
    --run=dummy, no wandb). The training scripts ask it at start-up, pretrain.sh before its downloads."""
    problem = None if run_name == "dummy" else wandb_login_problem(env)
    if problem:
        return (f"--run={run_name} logs to wandb, but {problem}: run `wandb login` (or set WANDB_API_KEY), or set "
                f"WANDB_MODE=offline to log into ./wandb and upload later with `wandb sync`, or pass --run=dummy for "
                f"no wandb")
    return None


# -----------------------------------------------------------------------------
# GPUs usable?

# Where a CUDA build of torch comes from; the cu number must be a CUDA version the driver supports.
TORCH_INDEX = "https://download.pytorch.org/whl"


def nvidia_smi_gpus():
    """The GPU lines of `nvidia-smi -L` ('GPU 0: NVIDIA H100 ...'), [] without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.startswith("GPU ")]


def driver_version():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return out[0] if out else None


def gpu_problem():
    """None when torch can use a GPU; otherwise the message saying why not and what to do."""
    try:
        import torch
    except Exception as e:
        return f"torch does not import ({type(e).__name__}: {e}): install nanochat first (pip install -e .)"
    with warnings.catch_warnings(record=True) as caught:  # torch explains a too-old driver in a warning
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    if available:
        return None
    gpus = nvidia_smi_gpus()
    if not gpus:
        return ("no NVIDIA GPU found (nvidia-smi is missing or lists none) and torch sees no CUDA device. "
                "This launcher is for GPU nodes; on a CPU machine run `bash runcpu.sh`.")
    build = f"torch {torch.__version__}"
    cuda = torch.version.cuda
    lines = [f"nvidia-smi lists {len(gpus)} GPU(s) ({gpus[0]}) but {build} cannot use them, "
             f"so training would silently run on the CPU."]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        lines.append(f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU: unset it.")
    elif cuda is None:
        lines.append(f"{build} is a CPU-only wheel (torch.version.cuda is None). Install a CUDA build, e.g. "
                     f"`pip install --force-reinstall torch --index-url {TORCH_INDEX}/cu128` "
                     f"(cu128 or lower: the CUDA version must be one the driver supports, see nvidia-smi's header).")
    else:
        driver = driver_version() or "unknown"
        lines.append(f"{build} is built for CUDA {cuda}; this machine's NVIDIA driver is {driver}. Either upgrade "
                     f"the driver to one that supports CUDA {cuda} (nvidia-smi's header shows the highest CUDA it "
                     f"supports), or install a torch wheel for an older CUDA, e.g. "
                     f"`pip install --force-reinstall torch --index-url {TORCH_INDEX}/cu126`.")
    for w in caught:
        lines.append(f"torch said: {str(w.message).strip()}")
    return "\n  ".join(lines)


# -----------------------------------------------------------------------------


def main(argv=None):
    from nanochat.configurator import Flag, Flags

    parser = Flags(
        Flag("check", None, "installed: is nanochat installed in this interpreter? gpu: can torch use the GPUs "
             "nvidia-smi lists?", type=str, choices=["installed", "gpu"], positional=True, required=True),
        Flag("extras", "", "installed: comma-separated optional dependency groups, e.g. dev"),
        Flag("quiet", False, "installed: print nothing, only the exit status"),
        prog="python -m nanochat.setup_check", description=__doc__,
    )
    args = parser.parse_args(argv)
    if args.check == "installed":
        extras = tuple(e for e in args.extras.split(",") if e)
        problems = install_problems(extras)
        if not args.quiet:
            if problems:
                print(f"nanochat is not (completely) installed in {sys.prefix}:", file=sys.stderr)
                for p in problems:
                    print(f"  - {p}", file=sys.stderr)
            else:
                print(f"nanochat is installed in {sys.prefix}")
        return 1 if problems else 0
    problem = gpu_problem()
    if problem:
        report(problem)
        return 1
    import torch
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees {torch.cuda.device_count()} GPU(s)")
    return 0


if __name__ == "__main__":
    run_main(main)
