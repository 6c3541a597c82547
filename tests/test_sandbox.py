"""
The sandboxed side: what a program can read (issue 31: only what the interpreter needs).
"""

import functools
import json
import os
import site
import sys
import sysconfig

import pytest

from nanochat.execution import REQUIRED_LAYERS, execute_code, isolation

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def layers():
    return isolation() if sys.platform == "linux" else frozenset()


def needs(*names):
    missing = [n for n in names if n not in layers()]
    return pytest.mark.skipif(bool(missing), reason=f"this machine's sandbox lacks {missing}: {sorted(layers())}")


isolated = needs(*REQUIRED_LAYERS)


# -----------------------------------------------------------------------------
# the readable-path probe: the program tries every path it can find (a walk from /, and a list of candidates that a
# walk cannot reach: the checkout, its .git, home directories, the host's keys, the task data) and reports each one it
# could read; everything it reports must be the standard library, site-packages, the system's libraries or its own
# work dir.

# What the interpreter needs from the system (shared libraries, the loader's cache, time zones, user names, CA
# certificates); written out here, not imported, so that widening the sandbox's list is a change this test sees.
SYSTEM = ["/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin", "/etc/ld.so.cache", "/etc/ld.so.conf",
          "/etc/ld.so.conf.d", "/etc/localtime", "/etc/timezone", "/etc/passwd", "/etc/group", "/etc/nsswitch.conf",
          "/etc/ssl/certs", "/etc/ssl/openssl.cnf", "/etc/mime.types", "/dev/null", "/dev/zero", "/dev/urandom",
          "/dev/random", "/dev/full"]

PROBE = r'''
import json, os, sys

def readable(path):
    try:
        if os.path.isdir(path):
            return os.listdir(path) is not None
        with open(path, "rb") as f:
            f.read(1)
        return True
    except OSError:
        return False

found, seen = [], 0
for path in CANDIDATES:
    if readable(path):
        found.append(path)
stack = ["/"]
while stack and seen < 300000:  # a walk of what can be listed; the allowed trees are not descended into
    top = stack.pop()
    try:
        entries = list(os.scandir(top))
    except OSError:
        continue
    found.append(top)
    for entry in entries:
        seen += 1
        if any(entry.path == p or entry.path.startswith(p.rstrip("/") + "/") for p in PRUNE):
            continue
        if entry.is_dir(follow_symlinks=False):
            stack.append(entry.path)
        elif readable(entry.path):
            found.append(entry.path)
print(json.dumps(sorted(set(found))))
'''


def inside(path, roots):
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


@functools.lru_cache(maxsize=None)
def python_dirs():
    """The standard library and site-packages of this interpreter (what `python -I` puts on sys.path from them)."""
    paths = sysconfig.get_paths()
    dirs = [paths["stdlib"], os.path.dirname(os.__file__), paths["purelib"], paths["platlib"]] + site.getsitepackages()
    return tuple(sorted({os.path.realpath(d) for d in dirs if os.path.isdir(d)}))


def git_dirs(checkout):
    """The checkout's .git and, for a worktree (.git is a file naming its gitdir), that gitdir and the main .git."""
    dot_git = os.path.join(checkout, ".git")
    found = [dot_git]
    if os.path.isfile(dot_git):
        with open(dot_git) as f:
            gitdir = f.read().split("gitdir:", 1)[-1].strip()
        found += [gitdir, os.path.dirname(os.path.dirname(gitdir))]  # <main>/.git/worktrees/<name> -> <main>/.git
    return found


def listing(path, depth=1):
    """path and what is under it, `depth` levels down (nothing where this process cannot list it)."""
    out = [path]
    if depth and os.path.isdir(path) and not os.path.islink(path):
        try:
            names = sorted(os.listdir(path))
        except OSError:
            return out
        for name in names:
            out += listing(os.path.join(path, name), depth - 1)
    return out


def candidates(extra=()):
    """Paths a program would try that a walk from / cannot reach when their parents cannot be listed."""
    found = []
    for root, dirs, files in os.walk(REPO):  # the checkout, except its virtualenv's site-packages (allowed)
        dirs[:] = [d for d in dirs if not inside(os.path.realpath(os.path.join(root, d)), python_dirs())]
        found += [root] + [os.path.join(root, name) for name in dirs + files]
    for gitdir in git_dirs(REPO):
        found += listing(gitdir, depth=2)
    homes = {os.path.expanduser("~"), "/root"} | {os.path.join("/home", name) for name in listing("/home")[1:]}
    for home in sorted(homes):
        found += listing(home, depth=2)
    found += listing("/etc", depth=1) + listing("/etc/ssl", depth=2)
    found += [sys.executable, sys.prefix, sys.base_prefix, os.path.realpath(sys.executable)]
    found += listing(sys.base_prefix, depth=2) + listing(sys.prefix, depth=2)
    found += [p for p in sys.path if os.path.isabs(p)]  # the editable install's checkout among them
    for name in ("NANOCHAT_BASE_DIR", "NANOCHAT_DATA_DIR"):
        if os.environ.get(name):
            found += listing(os.environ[name], depth=3)
    for up in [os.path.dirname(REPO), os.path.dirname(os.path.dirname(REPO))]:  # ../shared/data, ../../shared/data
        found += listing(os.path.join(up, "shared", "data"), depth=2)
    found += ["/", "/tmp", "/var", "/opt", "/srv", "/mnt", "/run", "/proc/self/environ", "/proc/1/environ"]
    return sorted(set(found) | set(extra))


def probe(extra=()):
    """Every path the sandboxed program could read, as the program reports them."""
    prune = sorted(set(list(python_dirs()) + SYSTEM + ["/proc", "/sys", "/dev"]))
    code = f"CANDIDATES = {candidates(extra)!r}\nPRUNE = {prune!r}\n" + PROBE
    r = execute_code(code, timeout=120, max_output_bytes=64 << 20)
    assert r.success, r
    return json.loads(r.stdout)


@isolated
def test_the_program_reads_only_the_standard_library_site_packages_and_system_libraries(tmp_path, monkeypatch):
    from tests.test_execution import humaneval_files

    base = tmp_path / "base"  # a user's base dir, with task data and a checkpoint
    (base / "data" / "humaneval").mkdir(parents=True)
    (base / "data" / "humaneval" / "HumanEval.jsonl").write_text('{"canonical_solution": "x"}\n')
    (base / "chatsft_checkpoints").mkdir()
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(base / "data"))
    answer_keys = [str(p) for p in humaneval_files()]
    assert len(answer_keys) >= 2
    found = probe(extra=answer_keys + [os.__file__, pytest.__file__, "/usr/lib", "/etc/passwd"])
    real = {path: os.path.realpath(path) for path in found}
    # the probe sees what can be read: the standard library, site-packages, the system's libraries
    for control in (os.__file__, pytest.__file__, "/usr/lib", "/etc/passwd"):
        assert control in found, f"the probe did not see {control}: {found[:20]}"
    allowed = list(python_dirs()) + [os.path.realpath(p) for p in SYSTEM]
    home = os.path.realpath(os.path.expanduser("~"))
    checkout = os.path.realpath(REPO)
    outside = [p for p in found if not inside(real[p], allowed)]
    assert [p for p in found if inside(real[p], [checkout]) and not inside(real[p], python_dirs())] == [], \
        "the checkout is readable"
    assert [p for p in found if ".git" in real[p].split("/")] == [], ".git is readable"
    assert [p for p in found if inside(real[p], [home, "/root", "/home"]) and not inside(real[p], python_dirs())] \
        == [], "a home directory is readable"
    assert [p for p in found if inside(real[p], ["/etc/ssl/private"])] == [], "the host's private keys are readable"
    assert [p for p in found if p in answer_keys or inside(real[p], [str(base)])] == [], "task data is readable"
    assert outside == [], f"readable outside the standard library, site-packages and the system's libraries: {outside}"
