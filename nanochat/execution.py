"""
Run untrusted, model-generated Python (HumanEval completions) inside a sandbox built from the Linux kernel.

    result = execute_code("def f():\\n    return 1\\nassert f() == 1")   # ExecutionResult(success=True)

Each program runs in a fresh `python -I` process (this file, run as a script), which applies, in this order and
as far as the machine allows:
- namespaces (user + mount + pid + net + ipc + uts, via unshare): no network interface but a down loopback, its own
  pid 1 so that everything it starts dies with it, an empty /proc (the host's processes and /proc/<ppid>/environ
  are invisible), and its working directory on a size-limited tmpfs (the total-disk cap);
- Landlock: read-only access to the system's libraries and Python's own directories (not the user's home, data,
  checkpoints or tokens, not /proc or /sys), write access only to its working directory, no execve of anything,
  no TCP (ABI >= 4), no signals or abstract sockets outside (ABI >= 6);
- seccomp: no fork/exec/vfork (threads are fine), kill/ptrace/process_vm_*, socket, mount/unshare/setns, bpf,
  io_uring, keyctl, ...; capabilities dropped and no_new_privs set;
- rlimits: address space, CPU time, file size, open files; a scrubbed environment; stdin is /dev/null.
Which layers this machine gives is detected once (isolation()) and logged; execute_code refuses to run without at
least the process + filesystem + network layers unless called with unsafe=True (--unsafe_sandbox in the scripts).

Success is decided outside the program: the program's code runs in a thread whose file-descriptor table no longer
holds the report pipe; the runner's main thread waits (in the kernel, on a pipe only that table keeps open) until
every thread of the program has ended, and only then writes "ok". So an exit before the end (sys.exit, os._exit(0),
an exception, a signal) is a failure, and there is no token to read because none exists.

What it does NOT isolate: the program can read the system's and Python's files (/usr, site-packages, ...), use CPU
and memory up to the limits, and, being Python, it can subvert its own checks (an object whose __eq__ is always True,
a trace hook that jumps over the asserts): the sandbox protects the machine and says whether the program ran to its
end, it does not judge whether the tests were honest. Kernel bugs are out of scope.
"""

import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

MEMORY_ERROR_EXIT = 86  # the runner exits with this when the code ran out of memory (MemoryError)
SYSTEM_EXIT_EXIT = 87  # the runner exits with this when the code raised SystemExit (exit(), sys.exit(...))
REFUSED_EXIT = 88  # the runner could not set up a layer that was required, and did not run the code
MAX_OUTPUT_BYTES = 1 << 20  # keep at most this much of stdout / stderr
DISK_BYTES = 64 << 20  # the working directory's tmpfs (total of everything the program writes)
MAX_OPEN_FILES = 256

# What "isolated" means for HumanEval-style evaluation: the program cannot run commands, signal or outlive itself
# (process), cannot change files outside its work dir nor read /proc (filesystem), cannot open a socket (network).
REQUIRED_LAYERS = ("process", "filesystem", "network")
UNSAFE_HINT = "pass --unsafe_sandbox (unsafe=True) to run generated code with what is available"


class SandboxUnavailable(RuntimeError):
    """This machine cannot give the sandbox the layers it needs (the message says which and what to do)."""


@dataclass
class ExecutionResult:
    success: bool  # every thread of the program ended normally, exit status 0, within the limits
    stdout: str
    stderr: str
    error: str | None = None  # short reason when not successful
    timeout: bool = False
    memory_exceeded: bool = False

    def __repr__(self):
        parts = [f"success={self.success}"]
        if self.timeout:
            parts.append("timeout=True")
        if self.memory_exceeded:
            parts.append("memory_exceeded=True")
        if self.error:
            parts.append(f"error={self.error!r}")
        if self.stdout:
            parts.append(f"stdout={self.stdout[:200]!r}")
        if self.stderr:
            parts.append(f"stderr={self.stderr[-200:]!r}")
        return f"ExecutionResult({', '.join(parts)})"


# -----------------------------------------------------------------------------
# The parent side: start the runner, collect its output and report, enforce the wall clock


def execute_code(code, timeout=5.0, maximum_memory_bytes=256 * 1024 * 1024, max_output_bytes=MAX_OUTPUT_BYTES,
                 disk_bytes=DISK_BYTES, unsafe=False):
    """
    Run `code` (a Python program as a string) in the sandbox and return an ExecutionResult.
    timeout: wall-clock seconds; maximum_memory_bytes: address-space cap (None or 0 disables it);
    disk_bytes: total size of the files it may write; unsafe: run even without the REQUIRED_LAYERS.
    """
    if timeout is None or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    required = [] if unsafe else list(REQUIRED_LAYERS)
    require_isolation(unsafe)
    run = _run(code, timeout, maximum_memory_bytes, max_output_bytes, disk_bytes, required=required)
    return run.result


def isolation():
    """The layers this machine gives the sandbox, detected once by running an empty program; logged once."""
    global _ISOLATION
    with _ISOLATION_LOCK:
        if _ISOLATION is None:
            run = _run("pass", timeout=30.0, maximum_memory_bytes=256 << 20, max_output_bytes=4096,
                       disk_bytes=1 << 20, required=[])
            if not run.result.success:
                raise SandboxUnavailable(f"the sandbox runner failed to start: {run.result.error}\n"
                                         f"{run.result.stderr}")
            _ISOLATION = run.layers
            logger.info("code sandbox isolation: %s", describe(_ISOLATION))
        return _ISOLATION


_ISOLATION = None
_ISOLATION_LOCK = threading.Lock()
_WARNED = []


def describe(layers):
    """One line: which of the REQUIRED_LAYERS hold, and the mechanisms behind them."""
    held = [name for name in REQUIRED_LAYERS if name in layers]
    missing = [name for name in REQUIRED_LAYERS if name not in layers]
    text = " + ".join(held) if held else "none"
    if missing:
        text += f" (missing: {', '.join(missing)})"
    mechanisms = sorted(m for m in layers if m not in REQUIRED_LAYERS)
    return f"{text}; mechanisms: {', '.join(mechanisms) or 'none'}"


def require_isolation(unsafe=False):
    """Raise SandboxUnavailable unless the REQUIRED_LAYERS hold here (or unsafe is set: then only log)."""
    layers = isolation()
    missing = [name for name in REQUIRED_LAYERS if name not in layers]
    if missing and unsafe:
        if not _WARNED:
            _WARNED.append(True)
            logger.warning("running generated code without the %s layer(s) of the sandbox (--unsafe_sandbox)",
                           ", ".join(missing))
    elif missing:
        raise SandboxUnavailable(
            f"the code sandbox lacks the {', '.join(missing)} layer(s) on this machine ({describe(layers)}); "
            f"{UNSAFE_HINT}. Linux >= 5.13 with Landlock and seccomp gives all three (see README, 'Code sandbox').")
    return layers


@dataclass
class _Run:
    result: ExecutionResult
    layers: frozenset


def _run(code, timeout, maximum_memory_bytes, max_output_bytes, disk_bytes, required):
    mem = int(maximum_memory_bytes or 0)
    cpu = int(timeout) + 2  # a backstop in case the wall clock kill fails; a tight loop uses ~1 CPU s per s
    workdir = tempfile.mkdtemp(prefix="nanochat_exec_")
    report_r, report_w = os.pipe()
    config = {"workdir": workdir, "report_fd": report_w, "mem": mem, "cpu": cpu, "disk": int(disk_bytes),
              "fsize": int(disk_bytes), "nofile": MAX_OPEN_FILES, "required": required}
    env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    # no native thread pools: they would outlive the program's last line (and the run waits for every thread)
    env.update(dict.fromkeys(["OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"], "1"))
    try:
        with tempfile.TemporaryFile() as source:  # the program reaches the runner as its stdin, then is gone
            source.write(code.encode("utf-8", errors="surrogatepass"))
            source.seek(0)
            proc = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), json.dumps(config)],
                                    cwd=workdir, env=env, stdin=source, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, pass_fds=(report_w,), start_new_session=True)
        os.close(report_w)
        report_w = None
        streams, timed_out = _collect(proc, report_r, timeout, max_output_bytes)
    finally:
        if report_w is not None:
            os.close(report_w)
        os.close(report_r)
        shutil.rmtree(workdir, ignore_errors=True)
    out, err, report = streams
    return _Run(_result(proc.returncode, out, err, report, timed_out, timeout, mem, cpu, max_output_bytes),
                _layers(report))


def _collect(proc, report_r, timeout, limit):
    """Read stdout, stderr and the report until all three close; past the deadline, kill the sandbox."""
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    kept = {out_fd: bytearray(), err_fd: bytearray(), report_r: bytearray()}
    sel = selectors.DefaultSelector()
    for fd in kept:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    timed_out = False
    while sel.get_map():
        left = deadline - time.monotonic()
        if left <= 0 and not timed_out:
            timed_out = True
            _kill(proc, kept[report_r])
            deadline = time.monotonic() + 10.0  # what is left in the pipes comes out right after the kill
            left = 10.0
        elif left <= 0:
            break  # something outside the sandbox holds a pipe open: stop reading, keep what we have
        for key, _ in sel.select(timeout=left):
            try:
                data = os.read(key.fd, 65536)
            except BlockingIOError:
                continue
            if not data:
                sel.unregister(key.fd)
                continue
            cap = limit if key.fd != report_r else 65536
            kept[key.fd] += data[:max(0, cap + 1 - len(kept[key.fd]))]
    sel.close()
    try:
        proc.wait(timeout=10.0)
    except subprocess.TimeoutExpired:
        _kill(proc, kept[report_r])
        proc.wait()
    proc.stdout.close()
    proc.stderr.close()
    return (kept[out_fd], kept[err_fd], kept[report_r]), timed_out


def _parse_report(report):
    """The runner's report: "pid N", "layers a,b", "refused why", "ok", then "exit N" or "signal N"."""
    parsed = {"ok": False}
    for line in bytes(report).decode("ascii", errors="replace").splitlines():
        key, _, value = line.partition(" ")
        if key == "ok":
            parsed["ok"] = True  # written by the runner, outside the program's reach, once all its threads ended
        elif key in ("pid", "exit", "signal") and value.lstrip("-").isdigit():
            parsed[key] = int(value)
        elif key == "layers":
            parsed["layers"] = frozenset(value.split(","))
        elif key == "refused":
            parsed["refused"] = value
    return parsed


def _kill(proc, report):
    # The runner's child is pid 1 of the sandbox's pid namespace: killing it ends everything inside. Without a pid
    # namespace, seccomp keeps the program from starting processes, and the runner's process group is all there is.
    pid = _parse_report(report).get("pid")
    for kill, target in ((os.kill, pid), (os.killpg, proc.pid)):
        if target is not None:
            try:
                kill(target, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _layers(report):
    return _parse_report(report).get("layers", frozenset())


def _text(data, limit):
    text = bytes(data[:limit]).decode("utf-8", errors="replace")
    return text + ("\n[output truncated]" if len(data) > limit else "")


def _result(returncode, out, err, report, timed_out, timeout, mem, cpu, limit):
    r = _parse_report(report)
    stdout, stderr = _text(out, limit), _text(err, limit)
    memory_exceeded = r.get("exit") == MEMORY_ERROR_EXIT
    last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if timed_out:
        error = f"timed out after {timeout} s"
    elif "refused" in r:
        error = f"the sandbox refused to run the code: {r['refused']}"
    elif "signal" in r:
        sig = r["signal"]
        error = f"killed by signal {signal.Signals(sig).name if sig in signal.valid_signals() else sig}"
        if sig in (signal.SIGXCPU, signal.SIGKILL):  # RLIMIT_CPU: SIGXCPU, then SIGKILL (pid 1 ignores SIGXCPU)
            timed_out, error = True, f"CPU time limit exceeded ({cpu} s)"
    elif "exit" not in r or returncode != 0:
        error = f"the sandbox runner failed (exit status {returncode}): {last}"
    elif memory_exceeded:
        error = f"memory limit exceeded ({mem} bytes)"
    elif r["exit"] == SYSTEM_EXIT_EXIT:
        error = last if last.startswith("SystemExit: the program called exit(") else \
            "SystemExit: the program called exit() before it ran to its end"
    elif r["exit"] != 0:
        error = last or f"exit status {r['exit']}"
    elif not r["ok"]:
        error = "the program exited (status 0) before it ran to its end, e.g. through os._exit()"
    else:
        error = None
    return ExecutionResult(success=error is None, stdout=stdout, stderr=stderr, error=error, timeout=timed_out,
                           memory_exceeded=memory_exceeded)


# -----------------------------------------------------------------------------
# The runner: this file run as a script (`python -I execution.py CONFIG`), stdin = the program.
#
#   L (this process, in the caller's pid namespace): unshare the namespaces, mount the tmpfs, fork R, report R's pid
#     and how R ended.
#   R (pid 1 of the new pid namespace): rlimits, Landlock, capabilities dropped, then a thread C runs the program.
#     C first unshares its file-descriptor table and drops the report pipe and the read end of the "alive" pipe from
#     it, then installs the seccomp filter (which also keeps it from closing the write end), then runs the code.
#     R's main thread closes its own write end, filters itself the same way and blocks reading the "alive" pipe: it
#     sees EOF only when C and every thread C started have ended, i.e. no exit_group() ended the process first.
#     Then, and only then, it reports "ok".

CLONE_FILES, CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x400, 0x20000, 0x4000000, 0x8000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET, CLONE_THREAD = 0x10000000, 0x20000000, 0x40000000, 0x10000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 1 << 14, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, PR_CAPBSET_DROP = 1, 38, 22, 24
SECCOMP_MODE_FILTER = 2
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO, SECCOMP_RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
EPERM, EACCES, ENOSYS = 1, 13, 38

# Landlock (include/uapi/linux/landlock.h): the syscalls have the same numbers on every architecture
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LL_EXECUTE, LL_WRITE_FILE, LL_READ_FILE, LL_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
LL_FILE_RIGHTS = LL_EXECUTE | LL_WRITE_FILE | LL_READ_FILE | (1 << 14) | (1 << 15)  # + TRUNCATE, IOCTL_DEV
SYSTEM_PATHS = ["/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin", "/etc/ld.so.cache",
                "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/timezone", "/etc/passwd", "/etc/group",
                "/etc/nsswitch.conf", "/etc/ssl", "/etc/mime.types"]
DEVICES = ["/dev/zero", "/dev/urandom", "/dev/random", "/dev/full"]
LL_FS_RIGHTS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1}  # later: (1 << 16) - 1

# seccomp: the syscalls the program may not make. Numbers are per architecture (x86_64: asm/unistd_64.h, aarch64:
# asm-generic/unistd.h, which has no fork/vfork/dup2/mknod); another architecture runs without the seccomp layer,
# and isolation() says so. tests/test_execution.py checks these tables against the kernel headers when installed.
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
SYSCALLS = {"x86_64": {
    "close": 3, "dup2": 33, "dup3": 292, "close_range": 436, "clone": 56, "clone3": 435, "socket": 41,
    "fork": 57, "vfork": 58, "execve": 59, "execveat": 322, "kill": 62, "tkill": 200, "tgkill": 234,
    "rt_sigqueueinfo": 129, "rt_tgsigqueueinfo": 297, "pidfd_open": 434, "pidfd_send_signal": 424,
    "pidfd_getfd": 438, "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312,
    "unshare": 272, "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "mount_setattr": 442,
    "bpf": 321, "perf_event_open": 298, "userfaultfd": 323, "keyctl": 250, "add_key": 248, "request_key": 249,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "setsid": 112, "setpgid": 109,
    "mknod": 133, "mknodat": 259, "name_to_handle_at": 303, "open_by_handle_at": 304, "init_module": 175,
    "finit_module": 313, "delete_module": 176, "kexec_load": 246, "kexec_file_load": 320, "reboot": 169,
    "acct": 163, "swapon": 167, "swapoff": 168, "quotactl": 179, "truncate": 76, "seccomp": 317,
}, "aarch64": {
    "close": 57, "dup3": 24, "close_range": 436, "clone": 220, "clone3": 435, "socket": 198,
    "execve": 221, "execveat": 281, "kill": 129, "tkill": 130, "tgkill": 131,
    "rt_sigqueueinfo": 138, "rt_tgsigqueueinfo": 240, "pidfd_open": 434, "pidfd_send_signal": 424,
    "pidfd_getfd": 438, "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272,
    "unshare": 97, "setns": 268, "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "mount_setattr": 442,
    "bpf": 280, "perf_event_open": 241, "userfaultfd": 282, "keyctl": 219, "add_key": 217, "request_key": 218,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "setsid": 157, "setpgid": 154,
    "mknodat": 33, "name_to_handle_at": 264, "open_by_handle_at": 265, "init_module": 105,
    "finit_module": 273, "delete_module": 106, "kexec_load": 104, "kexec_file_load": 294, "reboot": 142,
    "acct": 89, "swapon": 224, "swapoff": 225, "quotactl": 60, "truncate": 45, "seccomp": 277,
}}
DENIED = ["fork", "vfork", "execve", "execveat", "kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo",
          "pidfd_open", "pidfd_send_signal", "pidfd_getfd", "ptrace", "process_vm_readv", "process_vm_writev", "kcmp",
          "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen",
          "fsconfig", "fsmount", "mount_setattr", "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key",
          "request_key", "io_uring_setup", "io_uring_enter", "io_uring_register", "setsid", "setpgid", "mknod",
          "mknodat", "name_to_handle_at", "open_by_handle_at", "init_module", "finit_module", "delete_module",
          "kexec_load", "kexec_file_load", "reboot", "acct", "swapon", "swapoff", "quotactl",
          "seccomp"]  # (a filter synced onto the runner's thread could fake its read; prctl() cannot sync)


def _runner_main():
    import ctypes

    config = json.loads(sys.argv[1])
    report_fd = config["report_fd"]
    source = sys.stdin.buffer.read().decode("utf-8", errors="surrogatepass")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    libc = ctypes.CDLL(None, use_errno=True)
    layers = set()
    if sys.platform == "linux":
        _enter_namespaces(libc, config, layers)
    pid = os.fork()
    if pid == 0:
        try:
            _sandboxed_child(libc, config, source, layers)
        except BaseException as e:  # a setup error: say so on stderr, never run the code
            os.write(2, f"sandbox setup failed: {type(e).__name__}: {e}\n".encode("utf-8", errors="replace"))
        os._exit(REFUSED_EXIT)
    os.write(report_fd, f"pid {pid}\n".encode())
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        os.write(report_fd, f"signal {os.WTERMSIG(status)}\n".encode())
    else:
        os.write(report_fd, f"exit {os.WEXITSTATUS(status)}\n".encode())
    os._exit(0)


def _enter_namespaces(libc, config, layers):
    """New user/mount/pid/net/ipc/uts namespaces, the work dir on a capped tmpfs, /proc hidden. Best effort."""
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS) != 0:
        return  # e.g. unprivileged user namespaces disabled (Ubuntu 24.04's AppArmor default, docker's seccomp)
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    layers.update(["userns", "pidns", "netns"])
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return
    options = f"size={config['disk']},nr_inodes=4096,mode=0700".encode()
    if libc.mount(b"tmpfs", config["workdir"].encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options) == 0:
        layers.add("tmpfs")
    # L stays in the caller's pid namespace, so a fresh procfs here would show the caller's processes: hide it all
    if libc.mount(b"tmpfs", b"/proc", b"tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, b"size=4k") == 0:
        layers.add("noproc")


def _sandboxed_child(libc, config, source, layers):
    import _thread
    import builtins
    import ctypes
    import resource
    import traceback
    import types

    if sys.platform == "linux":
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # if L is killed, so is this pid 1 and its namespace
    os.chdir(config["workdir"])
    limits = [(resource.RLIMIT_FSIZE, config["fsize"]), (resource.RLIMIT_CORE, 0),
              (resource.RLIMIT_NOFILE, config["nofile"])]
    if config["mem"] > 0 and sys.platform != "darwin":  # macOS does not enforce RLIMIT_AS (and may refuse it)
        limits += [(resource.RLIMIT_AS, config["mem"]), (resource.RLIMIT_DATA, config["mem"])]
    for which, value in limits:
        resource.setrlimit(which, (value, value))
    resource.setrlimit(resource.RLIMIT_CPU, (config["cpu"], config["cpu"] + 1))
    layers.add("rlimits")
    if sys.platform == "linux":
        abi = _landlock(libc, config["workdir"])
        if abi:
            layers.add(f"landlock{abi}")
        _drop_capabilities(libc)
        libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    alive_r, alive_w = os.pipe()
    report_fd = config["report_fd"]
    # Landlock controls truncate(path) from ABI 3 on; before that, seccomp refuses it
    landlock_abi = max([int(n[len("landlock"):]) for n in layers if n.startswith("landlock")] or [0])
    program = _seccomp_program(alive_w, denied=DENIED + (["truncate"] if landlock_abi < 3 else []))
    ready, go = _thread.allocate_lock(), _thread.allocate_lock()
    ready.acquire()
    go.acquire()
    seccomp_installed = []
    flush = (sys.stdout.flush, sys.stderr.flush)
    _exit, _write = os._exit, os.write

    def code_thread():
        try:
            # a file-descriptor table of its own, without the report pipe and the read end: the program cannot
            # write "ok", and the write end (which it cannot close, see the filter) keeps the main thread waiting
            if sys.platform == "linux":  # elsewhere the program shares the table: no protection of "ok"
                if libc.unshare(CLONE_FILES) != 0:
                    raise OSError(ctypes.get_errno(), "unshare(CLONE_FILES) failed")
                os.close(alive_r)
                os.close(report_fd)
            if program is not None and _install_seccomp(libc, program):
                seccomp_installed.append(True)
        except BaseException as e:
            _write(2, f"sandbox setup failed: {e}\n".encode("utf-8", errors="replace"))
            _exit(REFUSED_EXIT)
        ready.release()
        go.acquire()  # the main thread checked the layers
        main = types.ModuleType("__main__")  # the program is __main__ (pickle, dataclasses and doctest look there)
        main.__builtins__ = builtins
        sys.modules["__main__"], sys.argv = main, ["<generated>"]
        try:
            exec(compile(source, "<generated>", "exec"), main.__dict__)
            _flush_quietly(flush)  # (a program may have closed sys.stdout: that is no failure)
        except MemoryError:
            _flush_quietly(flush)
            _write(2, b"MemoryError: the code exceeded the sandbox memory limit\n")
            _exit(MEMORY_ERROR_EXIT)
        except SystemExit as e:
            _flush_quietly(flush)
            msg = f"SystemExit: the program called exit({e.code!r}) before it ran to its end, which counts as a failure\n"
            _write(2, msg.encode("utf-8", errors="replace"))
            _exit(SYSTEM_EXIT_EXIT)
        except BaseException as e:
            try:
                traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # from the generated code down
            finally:
                _flush_quietly(flush)
                _exit(1)  # not a thread exit: an exception must end the process, or "ok" would follow

    _thread.start_new_thread(code_thread, ())
    ready.acquire()
    os.close(alive_w)
    # what the layers add up to (see REQUIRED_LAYERS)
    if seccomp_installed:
        layers.update(["seccomp", "process", "network"])
    if "netns" in layers:
        layers.add("network")
    if any(name.startswith("landlock") for name in layers):
        layers.add("filesystem")
    os.write(report_fd, f"layers {','.join(sorted(layers))}\n".encode())
    missing = [name for name in config["required"] if name not in layers]
    if missing:
        os.write(report_fd, f"refused missing layers: {', '.join(missing)}\n".encode())
        _exit(REFUSED_EXIT)
    if seccomp_installed:
        _install_seccomp(libc, program)  # the main thread is no less confined than the program
    # signals now go to the program's threads: nothing interrupts this thread's wait to run a handler here
    signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    go.release()
    read = os.read
    while read(alive_r, 1):  # EOF: the last thread holding the write end (the program's table) has ended
        pass
    _flush_quietly(flush)
    _write(report_fd, b"ok\n")
    _exit(0)


def _flush_quietly(flush):
    for f in flush:
        try:
            f()
        except BaseException:
            pass


def _landlock(libc, workdir):
    """Read-only access to _readable_paths(), full access to the work dir, no execve; returns the ABI or 0."""
    import ctypes
    import struct

    abi = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if abi < 1:
        return 0
    fs_rights = LL_FS_RIGHTS_BY_ABI.get(abi, (1 << 16) - 1)
    net_rights = 0b11 if abi >= 4 else 0  # TCP bind + connect, with no rule allowing either
    scoped = 0b11 if abi >= 6 else 0  # abstract unix sockets + signals outside the sandbox
    attr = struct.pack("QQQ", fs_rights, net_rights, scoped)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    ruleset = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, attr, ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        return 0
    read_only = LL_READ_FILE | LL_READ_DIR
    devices = [("/dev/null", LL_READ_FILE | LL_WRITE_FILE)] + [(d, LL_READ_FILE) for d in DEVICES]
    rules = [(path, read_only) for path in _readable_paths()] + devices + [(workdir, fs_rights & ~LL_EXECUTE)]
    try:
        for path, rights in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                if not os.path.isdir(path):
                    rights &= LL_FILE_RIGHTS
                rule = struct.pack("=Qi", rights & fs_rights, fd)
                if libc.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, 1, rule, ctypes.c_uint32(0)) != 0:
                    return 0
            finally:
                os.close(fd)
        libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        if libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)) != 0:
            return 0
    finally:
        os.close(ruleset)
    return abi


def _readable_paths():
    """What a Python program needs to read: the system's libraries and Python's own directories, nothing of the
    user's (home, data, checkpoints, tokens)."""
    paths = list(SYSTEM_PATHS)
    paths += [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    paths += [p for p in sys.path if p and os.path.isabs(p) and os.path.isdir(p)]  # site-packages and the like
    return sorted(set(paths))


def _drop_capabilities(libc):
    """No capabilities left (root in the container, or the owner of the user namespace), none to regain."""
    import ctypes

    for cap in range(64):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # fails quietly without CAP_SETPCAP or past the last cap
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable x 2: all zero
    libc.capset(header, data)


def _seccomp_program(alive_w, denied):
    """The BPF filter as a list of (code, jt, jf, k), or None where there is no syscall table for this machine."""
    import platform

    arch = platform.machine()
    if sys.platform != "linux" or arch not in SYSCALLS:
        return None
    nr = SYSCALLS[arch]
    ld, jeq, jset, jge, ret = 0x20, 0x15, 0x45, 0x35, 0x06
    deny = SECCOMP_RET_ERRNO | EPERM
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, AUDIT_ARCH[arch]), (ret, 0, 0, SECCOMP_RET_KILL_PROCESS), (ld, 0, 0, 0)]
    if arch == "x86_64":
        prog += [(jge, 0, 1, 0x40000000), (ret, 0, 0, deny)]  # the x32 ABI: another numbering, not filtered
    for name in denied:
        if name in nr:  # aarch64 has no fork, vfork or mknod to deny
            prog += [(jeq, 0, 1, nr[name]), (ret, 0, 0, deny)]
    arg = lambda i: (ld, 0, 0, 16 + 8 * i)  # noqa: E731  low 32 bits of argument i (little endian)
    # threads yes, processes no
    prog += [(jeq, 0, 4, nr["clone"]), arg(0), (jset, 0, 1, CLONE_THREAD), (ret, 0, 0, SECCOMP_RET_ALLOW),
             (ret, 0, 0, deny)]
    prog += [(jeq, 0, 1, nr["clone3"]), (ret, 0, 0, SECCOMP_RET_ERRNO | ENOSYS)]  # glibc falls back to clone
    prog += [(jeq, 0, 1, nr["socket"]), (ret, 0, 0, SECCOMP_RET_ERRNO | EACCES)]  # socketpair() stays possible
    prog += [(jeq, 0, 1, nr["close_range"]), (ret, 0, 0, SECCOMP_RET_ERRNO | ENOSYS)]  # Python falls back to close
    # the write end of the "alive" pipe stays open until the program's threads are gone
    prog += [(jeq, 0, 4, nr["close"]), arg(0), (jeq, 0, 1, alive_w), (ret, 0, 0, deny), (ret, 0, 0, SECCOMP_RET_ALLOW)]
    for name in [n for n in ("dup2", "dup3") if n in nr]:
        prog += [(jeq, 0, 4, nr[name]), arg(1), (jeq, 0, 1, alive_w), (ret, 0, 0, deny),
                 (ret, 0, 0, SECCOMP_RET_ALLOW)]
    prog.append((ret, 0, 0, SECCOMP_RET_ALLOW))
    return prog


def _install_seccomp(libc, prog):
    """Install the filter on the calling thread (and the threads it starts). False if the kernel refused it."""
    import ctypes
    import struct

    raw = b"".join(struct.pack("HBBI", *ins) for ins in prog)
    buf = ctypes.create_string_buffer(raw, len(raw))
    fprog = struct.pack("HxxxxxxQ", len(prog), ctypes.addressof(buf))  # struct sock_fprog {u16 len; filter *}
    return libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.c_char_p(fprog), 0, 0) == 0


if __name__ == "__main__":
    _runner_main()
