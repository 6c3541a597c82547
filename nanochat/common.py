"""
Small utilities every part of nanochat uses: the base directory, rank-0 printing, logging, wandb, peak FLOPS.
Device detection and torch.distributed setup/teardown are in nanochat/distributed/dist.py (re-exported here: nanochat's
`from nanochat.common import compute_init, get_dist_info` keeps working).
"""

import logging
import os
import sys

import torch

# torch.distributed setup lives in nanochat/distributed/dist.py; nanochat's scripts import these names from here
from nanochat.distributed.dist import autodetect_device_type, compute_cleanup, compute_init, get_dist_info  # noqa: F401
from nanochat.usage import BadValue, CannotRun

# -----------------------------------------------------------------------------
# Logging: one format for every entrypoint, colours only on a terminal.


class _ColoredFormatter(logging.Formatter):
    COLORS = {"DEBUG": "\033[36m", "INFO": "\033[32m", "WARNING": "\033[33m", "ERROR": "\033[31m", "CRITICAL": "\033[35m"}
    RESET = "\033[0m"

    def __init__(self, fmt, use_color):
        super().__init__(fmt, datefmt="%Y-%m-%d %H:%M:%S")
        self.use_color = use_color

    def format(self, record):
        msg = super().format(record)
        if self.use_color and record.levelname in self.COLORS:
            msg = msg.replace(record.levelname, f"{self.COLORS[record.levelname]}{record.levelname}{self.RESET}", 1)
        return msg


def setup_default_logging(level=logging.INFO):
    root = logging.getLogger()
    if any(getattr(h, "_nanochat", False) for h in root.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler._nanochat = True
    handler.setFormatter(_ColoredFormatter("%(asctime)s - %(name)s - %(levelname)s - %(message)s", sys.stderr.isatty()))
    root.addHandler(handler)
    root.setLevel(level)


setup_default_logging()
logger = logging.getLogger(__name__)

# -----------------------------------------------------------------------------
# Paths


def get_base_dir():
    """Where nanochat keeps data, tokenizer, checkpoints and reports: $NANOCHAT_BASE_DIR or ~/.cache/nanochat."""
    base = os.environ.get("NANOCHAT_BASE_DIR")
    if not base:
        base = os.path.join(os.path.expanduser("~"), ".cache", "nanochat")
    if os.path.exists(base) and not os.path.isdir(base):
        raise BadValue(f"NANOCHAT_BASE_DIR={base} is a file, not a directory: point it at a directory")
    os.makedirs(base, exist_ok=True)
    return base


# -----------------------------------------------------------------------------
# Printing


def print0(*args, **kwargs):
    """print() on rank 0 only (rank read from the environment so it works before init_process_group)."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kwargs)


def print_banner():
    print0(
        "\n"
        "  _ __   __ _ _ __   ___   ___| |__   __ _| |_ \n"
        " | '_ \\ / _` | '_ \\ / _ \\ / __| '_ \\ / _` | __|\n"
        " | | | | (_| | | | | (_) | (__| | | | (_| | |_ \n"
        " |_| |_|\\__,_|_| |_|\\___/ \\___|_| |_|\\__,_|\\__|\n"
    )


class DummyWandb:
    """Stands in for a wandb run when --run=dummy: logging goes nowhere."""

    def log(self, *args, **kwargs):
        pass

    def finish(self):
        pass


def check_wandb(run_name, master_process=None):
    """The start-up check of --run: a wandb run needs a login (on the rank that logs, global rank 0), or the run would
    fail once the model is built (nanochat.setup_check.wandb_problem: log in, log offline, or no wandb)."""
    from nanochat.setup_check import wandb_problem

    master_process = int(os.environ.get("RANK", 0)) == 0 if master_process is None else master_process
    problem = wandb_problem(run_name) if master_process else None
    if problem:
        raise CannotRun(problem)


def get_wandb(run_name, project, config, master_process):
    """A real wandb run when a run name is given on the master process, else DummyWandb."""
    if run_name == "dummy" or not master_process:
        return DummyWandb()
    import wandb

    return wandb.init(project=project, name=run_name, config=config)


# -----------------------------------------------------------------------------
# Peak dense bf16 FLOPS per device, for MFU. Matched by substring of torch.cuda.get_device_name(), most specific first.
PEAK_FLOPS = [
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM
    ("H800", 989e12),
    ("H20", 148e12),
    ("B200", 2250e12),
    ("GH200", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10", 125e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
    ("V100", 125e12),
    ("T4", 65e12),
]


def peak_flops_for(device):
    """Peak bf16 FLOPS of a CUDA device (torch.device, index or name), or None when unknown or not CUDA (no MFU on CPU)."""
    if isinstance(device, str) and device not in ("cuda",) and not device.startswith("cuda:"):
        name = device  # a device name was given directly
    else:
        dev = torch.device(device) if not isinstance(device, torch.device) else device
        if dev.type != "cuda" or not torch.cuda.is_available():
            return None
        name = torch.cuda.get_device_name(dev)
    for key, flops in PEAK_FLOPS:
        if key in name:
            return flops
    return None


def device_type_flag():
    """--device_type, as every entry point that picks a device declares it (auto: autodetect_device_type)."""
    from nanochat.configurator import Flag

    return Flag("device_type", None, "cuda | cpu | mps; auto = cuda if available, else mps, else cpu", type=str,
                choices=["cuda", "cpu", "mps"])
