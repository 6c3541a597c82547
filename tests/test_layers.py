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
    assert {"core_eval.py", "chat_eval.py", "dataset.py"} <= names
    library = set((REPO / "nanochat").rglob("*.py"))  # subpackages are read too
    assert {REPO / "nanochat" / "serving" / "app.py", REPO / "nanochat" / "data" / "conversations.py"} <= library


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


# -----------------------------------------------------------------------------
# No import circles inside the library: what a module imports while it is being imported (everything outside function
# bodies and outside `if __name__ == "__main__":`) forms a graph without cycles. A lazy import inside a function is
# how a lower layer reaches an upper one (nanochat.dataset's command line runs nanochat/data/cli.py that way).


def _import_time_nodes(tree):
    """The import statements of a module that run when it is imported."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) and "__name__" in ast.unparse(node.test):
            stack += node.orelse
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        else:
            stack += list(ast.iter_child_nodes(node))


def import_graph(root, package="nanochat"):
    """{module: set of modules of the package it imports at import time}, module names dotted ('nanochat.data.cli')."""
    files = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        here = name if is_package else name.rpartition(".")[0]  # the package a relative import starts from
        targets = set()
        for node in _import_time_nodes(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
                continue
            base = node.module or ""
            if node.level:
                anchor = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
                base = f"{anchor}.{base}" if base else anchor
            targets.add(base)
            targets |= {f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in files}
        edges = set()
        for target in targets:
            # importing a.b.c runs a, a.b and a.b.c; the packages that contain this module are already being imported
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix in files and prefix != name and not name.startswith(prefix + "."):
                    edges.add(prefix)
        graph[name] = edges
    return graph


def import_circles(root, package="nanochat"):
    """Each import circle as 'a -> b -> ... -> a', found by a depth-first search (one per back edge)."""
    graph = import_graph(root, package)
    state, stack, found = {}, [], []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for nxt in sorted(graph[module]):
            if state.get(nxt) == "open":
                found.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return found


def test_the_library_has_no_import_circle():
    graph = import_graph(REPO)
    assert {"nanochat.dataset", "nanochat.data.cli", "nanochat.data.download"} <= set(graph)  # the package is read
    assert "nanochat.dataset" in graph["nanochat.data.download"]  # and its edges
    circles = import_circles(REPO)
    assert not circles, "import circles in nanochat/ (make one of the imports lazy or move the code down):\n" + \
        "\n".join(circles)


def test_an_import_circle_is_caught(tmp_path):
    pkg = tmp_path / "nanochat"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "data" / "__init__.py").write_text("")
    (pkg / "bottom.py").write_text("import os\n\ndef main():\n    from nanochat.data import cli\n\n"
                                   "if __name__ == '__main__':\n    from nanochat.data.cli import main\n")
    (pkg / "data" / "cli.py").write_text("from nanochat.bottom import main\nfrom . import download\n")
    (pkg / "data" / "download.py").write_text("from .. import bottom\n")
    assert import_circles(tmp_path) == []  # lazy and __main__ imports are not import-time edges
    (pkg / "bottom.py").write_text("try:\n    from nanochat.data.download import x\nexcept ImportError:\n    pass\n")
    assert import_circles(tmp_path) == ["nanochat.bottom -> nanochat.data.download -> nanochat.bottom"]
    (pkg / "data" / "__init__.py").write_text("from nanochat.data.cli import main\n")  # a package's __init__ counts
    (pkg / "bottom.py").write_text("import nanochat.data.download\n")
    assert import_circles(tmp_path) == [
        "nanochat.bottom -> nanochat.data -> nanochat.data.cli -> nanochat.bottom",
        "nanochat.bottom -> nanochat.data -> nanochat.data.cli -> nanochat.data.download -> nanochat.bottom",
    ]
