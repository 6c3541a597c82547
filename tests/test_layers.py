"""
The layers point down only: scripts -> tasks -> nanochat. The library (nanochat/) never imports tasks/ or scripts/,
tasks/ never imports scripts/, and no script imports another script (shared code belongs in the library).

The import graph is read from the source with `ast`, nothing is imported: an import inside a function counts the
same as one at the top, and so does a module named in a string to importlib (import_module, find_spec, __import__).
"""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# package -> the top-level packages it must not import
FORBIDDEN = {
    "nanochat": {"tasks", "scripts"},
    "tasks": {"scripts"},
    "scripts": {"scripts"},
}
DYNAMIC_IMPORTERS = {"import_module", "find_spec", "__import__"}


def imported_modules(path, package):
    """(line, dotted module name) for every module the file at `path` (inside `package`) imports."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: `from . import x` inside package P is an import of P
                found.append((node.lineno, package + (f".{node.module}" if node.module else "")))
            elif node.module == "scripts" or node.module == "tasks":  # `from scripts import chat_eval`
                found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in DYNAMIC_IMPORTERS and node.args and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def violations(root):
    """'path:line imports module' for every import in root/{nanochat,tasks,scripts}/**/*.py that points the wrong way."""
    bad = []
    for package, forbidden in FORBIDDEN.items():
        for path in sorted((root / package).rglob("*.py")):  # subpackages too (nanochat/serving, ...)
            for line, module in imported_modules(path, package):
                if module.split(".")[0] in forbidden:
                    bad.append(f"{path.relative_to(root)}:{line} imports {module}")
    return bad


def test_layers_point_down_only():
    bad = violations(REPO)
    assert not bad, "imports against the layering (scripts -> tasks -> nanochat):\n" + "\n".join(bad)


def test_every_package_is_checked():
    """The check reads real files: each layer has modules, and the library's include the ones that once broke it."""
    for package in FORBIDDEN:
        assert list((REPO / package).glob("*.py")), f"no modules found in {package}/"
    names = {p.name for p in (REPO / "nanochat").glob("*.py")}
    assert {"conversation_data.py", "core_eval.py", "chat_eval.py", "dataset.py"} <= names
    assert REPO / "nanochat" / "serving" / "app.py" in set((REPO / "nanochat").rglob("*.py"))  # subpackages are read too


@pytest.mark.parametrize("source, expected", [
    ("from tasks.common import TaskMixture\n", "nanochat/bad.py:1 imports tasks.common"),
    ("def f():\n    from scripts.chat_eval import main\n", "nanochat/bad.py:2 imports scripts.chat_eval"),
    ("import importlib.util\nok = importlib.util.find_spec('scripts.chat_eval')\n",
     "nanochat/bad.py:2 imports scripts.chat_eval"),
    ("import tasks.arc as arc\n", "nanochat/bad.py:1 imports tasks.arc"),
])
def test_a_library_import_of_an_upper_layer_is_caught(tmp_path, source, expected):
    for package in FORBIDDEN:
        (tmp_path / package).mkdir()
    (tmp_path / "nanochat" / "bad.py").write_text(source)
    (tmp_path / "nanochat" / "good.py").write_text("import torch\nfrom nanochat.common import print0\nfrom . import common\n")
    assert violations(tmp_path) == [expected]


def test_a_script_importing_a_script_is_caught(tmp_path):
    for package in FORBIDDEN:
        (tmp_path / package).mkdir()
    (tmp_path / "scripts" / "a.py").write_text("from tasks.arc import ARC\nfrom nanochat.engine import Engine\n")
    (tmp_path / "scripts" / "b.py").write_text("from scripts import chat_eval\n")
    (tmp_path / "tasks" / "c.py").write_text("from scripts.chat_sft import main\n")
    assert violations(tmp_path) == ["tasks/c.py:1 imports scripts.chat_sft", "scripts/b.py:1 imports scripts.chat_eval"]
