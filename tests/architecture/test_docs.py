"""
README.md and docs/ send the reader to each other: every relative link in them leads to a file of the repository and,
with a `#section`, to a heading of that file (GitHub's anchors), so moving a section cannot leave a dead link behind.
The code map of docs/architecture.md names every module and script, and the commands the pages show are found here
so that tests/architecture/test_configurator.py can check each flag against that command's --help. (The README's size and first
screen: tests/architecture/test_layers.py. What the docs promise is tested where the code is.)
"""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```")


def prose_lines(text):
    """The lines of a markdown text outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            out.append(line)
    return out


def anchor(heading):
    """GitHub's anchor of a heading: lower case, punctuation other than - and _ dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path):
    return {anchor(line.lstrip("#")) for line in prose_lines(path.read_text(encoding="utf-8")) if line.startswith("#")}


def dead_links(page, root=REPO):
    """'page: target (why)' for every relative link of a markdown page that leads nowhere."""
    dead = []
    for line in prose_lines(page.read_text(encoding="utf-8")):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, section = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists() or root.resolve() not in dest.parents:
                dead.append(f"{page.relative_to(root)}: {target} (no such file)")
            elif section and dest.suffix == ".md" and section not in anchors(dest):
                dead.append(f"{page.relative_to(root)}: {target} (no heading #{section} in {file or page.name})")
    return dead


def pages(root=REPO):
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def test_the_docs_links_lead_somewhere():
    assert len(pages()) > 10
    dead = [d for page in pages() for d in dead_links(page)]
    assert not dead, "dead links:\n" + "\n".join(dead)


def test_the_readme_links_every_docs_page():
    """Each docs/ page is reachable from the README (the 'Read more' table)."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    unlinked = [p.name for p in pages()[1:] if f"(docs/{p.name}" not in readme]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def map_block(root=REPO):
    """The code map in docs/architecture.md: the fenced block under '## The map'."""
    text = (root / "docs" / "architecture.md").read_text(encoding="utf-8")
    return text[text.index("## The map"):].split("```")[1]


def code_files(root=REPO):
    """What the map must place: every Python module of nanochat/ (its subpackages' modules too), scripts/, tasks/ and
    bench/, every subpackage, and every shell script of the repository's own code."""
    py = [p for d in ("nanochat", "scripts", "tasks", "bench") for p in (root / d).rglob("*.py")]
    modules = {p.stem for p in py if p.stem != "__init__"} | {p.parent.name for p in py if p.stem == "__init__"}
    modules -= {"scripts", "tasks", "bench"}  # the top-level folders are the map's rows
    shells = {p.name for d in ("", "scripts", "bench", "tests", "volc") for p in (root / d).glob("*.sh")}
    return modules, shells


def unmapped(root=REPO):
    block = map_block(root)
    words = set(re.findall(r"[A-Za-z_]\w*", block))
    modules, shells = code_files(root)
    return sorted(m for m in modules if m not in words) + sorted(s for s in shells if s not in block)


def test_the_code_map_names_every_module():
    """docs/architecture.md's map names every module, subpackage and shell script: a new one is placed on it."""
    modules, shells = code_files()
    assert {"gpt", "checkpoint", "train_state", "launch", "pipeline", "base_train", "arc", "train_bench"} <= modules
    assert {"runcpu.sh", "lib.sh", "gpu_suite.sh", "run.sh", "volc_submit.sh"} <= shells
    missing = unmapped()
    assert not missing, f"not on the map in docs/architecture.md (add them to it): {missing}"


def test_unmapped_modules_are_caught(tmp_path):
    for f in ("nanochat/gpt.py", "nanochat/optim/__init__.py", "nanochat/optim/sharded.py", "scripts/base_train.py",
              "bench/new_bench.py", "runcpu.sh", "bench/x.sh"):
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "architecture.md").write_text(
        "# A\n\ngpt new_bench x.sh\n\n## The map\n\n```\nnanochat/ gpt, optim/ (sharded)\nscripts/ base_train\n"
        "runcpu.sh\n```\n")
    assert unmapped(tmp_path) == ["new_bench", "x.sh"]


# The commands the pages show: `python -m scripts.X --flag`, `torchrun ... -m scripts.X`, `bash runcpu.sh --flag`.
# tests/architecture/test_configurator.py checks each flag against the entry point's own --help (it imports them all already).
SCRIPTS = "|".join(sorted(p.stem for p in (REPO / "scripts").glob("*.py") if p.stem != "__init__"))
COMMAND = re.compile(r"(?:python3?|torchrun)\b[^`\n]*?\s-m\s+((?:scripts|bench|nanochat)\.\w+)([^`\n#|;&]*)"
                     r"|\bbash\s+((?:runcpu|speedrun|run1000|pretrain)\.sh)([^`\n#|;&]*)"
                     rf"|`(?:scripts\.)?({SCRIPTS})(\s[^`]*)`")  # inline: `base_train --fp8=1`
SHOWN_AS_MISTAKES = {"dpeth"}  # docs/flags.md and multinode.md show what a misspelt flag does


def doc_commands(pages_=None):
    """(page, entry point, subcommand words, flag names) of every command the pages show, flags as --help spells them
    (dashes inside a name -> underscores; a short flag as its letter)."""
    out = []
    for page in pages_ or pages():
        for line in page.read_text(encoding="utf-8").splitlines():
            for m in COMMAND.finditer(line):
                entry, rest = next((m.group(i), m.group(i + 1)) for i in (1, 3, 5) if m.group(i))
                entry = f"scripts.{entry}" if m.group(5) else entry
                if entry == "scripts.X":
                    continue
                words = rest.split()
                sub = words[:1] if words and re.fullmatch(r"[a-z]+", words[0]) and entry == "nanochat.dataset" else []
                flags = {f.lstrip("-").split("=")[0].replace("-", "_")
                         for f in re.findall(r"(?<![\w./-])(--?[A-Za-z][\w-]*(?:=\S*)?)", rest)}
                out.append((page.name, entry, sub, sorted(flags - SHOWN_AS_MISTAKES)))
    return out


def test_doc_commands_are_found(tmp_path):
    page = tmp_path / "a.md"
    page.write_text("```bash\ntorchrun --nproc_per_node=8 -m scripts.base_train --depth=20 --device-batch-size 32\n"
                    ".venv/bin/python -m scripts.chat_cli -i sft -p \"Why?\"   # -x in a comment\n```\n"
                    "Run `bash pretrain.sh --dpeth=4 --run=x` or `python -m nanochat.dataset import a.txt --out d`,\n"
                    "`chat_rl --use_fsdp=1` not `chat_rl` or `chat_rlx --y`.\n")
    assert doc_commands([page]) == [("a.md", "scripts.base_train", [], ["depth", "device_batch_size"]),
                                    ("a.md", "scripts.chat_cli", [], ["i", "p"]),
                                    ("a.md", "pretrain.sh", [], ["run"]),
                                    ("a.md", "nanochat.dataset", ["import"], ["out"]),
                                    ("a.md", "scripts.chat_rl", [], ["use_fsdp"])]
    assert len(doc_commands()) > 50


@pytest.mark.parametrize("heading, expected", [
    ("Tensor parallelism: FSDP2 x TP (`--tp_size=N`)", "tensor-parallelism-fsdp2-x-tp---tp_sizen"),
    ("Attention (`--attn`, `nanochat/attention.py`)", "attention---attn-nanochatattentionpy"),
    ("runcpu.sh: the whole pipeline on a CPU", "runcpush-the-whole-pipeline-on-a-cpu"),
])
def test_anchor_is_githubs(heading, expected):
    assert anchor(heading) == expected


def test_dead_links_are_caught(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## Two words\n")
    page = tmp_path / "README.md"
    page.write_text("[ok](docs/a.md#two-words) [ok](https://x.org/#y) [ok](#top)\n# Top\n"
                    "[gone](docs/b.md) [moved](docs/a.md#three-words)\n```\n[in code](docs/c.md)\n```\n")
    assert dead_links(page, tmp_path) == ["README.md: docs/b.md (no such file)",
                                          "README.md: docs/a.md#three-words (no heading #three-words in docs/a.md)"]
