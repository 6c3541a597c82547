"""
pyflakes' checks over every Python file of the project, through ruff ([tool.ruff] in pyproject.toml: rules F and E9,
syntax for Python 3.10, the oldest we support). The point is the code CI cannot run: bench/gpu_suite's scripts and the
CUDA branches only execute on a GPU, so an undefined name there would first show on a lent H100. `# noqa: F401` marks
the deliberate imports (nanochat's import names re-exported, imports that check a package is installed).
"""

import subprocess
import sys

from conftest import REPO

CHECKED = ["nanochat", "scripts", "tasks", "bench", "tests"]


def ruff(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def test_every_python_file_passes_the_pyflakes_rules():
    p = ruff(*CHECKED)
    assert p.returncode == 0, f"fix these (or mark a deliberate import `# noqa: F401`):\n{p.stdout}{p.stderr}"


def test_the_project_rules_catch_an_undefined_name_and_3_11_syntax(tmp_path):
    """The check above can fail: with the project's settings, a GPU-only branch that names something undefined, an
    unused import and an `except*` (Python 3.11) are each reported."""
    bad = tmp_path / "gpu_only.py"
    bad.write_text("import os\n\n\ndef probe(device):\n    if device == 'cuda':\n        return torch.cuda.max_memory_allocated()\n"
                   "\n\ndef guarded():\n    try:\n        pass\n    except* ValueError:\n        pass\n")
    p = ruff("--config", str(REPO / "pyproject.toml"), str(bad))
    assert p.returncode == 1
    assert "F821" in p.stdout and "`torch`" in p.stdout  # undefined name
    assert "F401" in p.stdout and "`os`" in p.stdout  # unused import
    assert "except*" in p.stdout and "3.10" in p.stdout  # newer syntax than requires-python allows
