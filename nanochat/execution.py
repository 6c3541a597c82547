"""
Run untrusted, model-generated Python (HumanEval completions) in a separate process.

What the sandbox does:
- a fresh `python -I` subprocess (isolated mode: no PYTHON* env vars, no user site, cwd not on sys.path),
  in its own session so a timeout kills it and anything it started;
- a temporary working directory that is deleted afterwards; HOME and TMPDIR point into it;
- a scrubbed environment (PATH, HOME, TMPDIR, LANG only: no tokens, keys or proxy settings leak in);
- no stdin (/dev/null); stdout and stderr go to files in the temp dir, capped by RLIMIT_FSIZE, so a program
  that prints forever cannot fill our memory;
- a wall-clock timeout, an address-space cap (RLIMIT_AS; Linux only, macOS does not enforce it) and a CPU-time cap;
- before the code runs, destructive functions are replaced by stubs that raise PermissionError: os.system,
  os.kill, os.remove/unlink/rmdir/rename/..., os.fork/exec*/spawn*, shutil.rmtree/move/chown, subprocess.Popen
  and friends, os.chdir; the same stubs go on the `posix` (or `nt`) module that os re-exports, on
  _posixsubprocess.fork_exec (and the module is made unimportable) and on signal.pidfd_send_signal;
- success means the program ran to its end: exit status 0 AND a completion marker holding a random per-run token
  that the runner writes only after the program returned normally. The token reaches the runner through a file it
  deletes before the code runs (not argv or the environment, which /proc would show). So exit(), sys.exit(0),
  raise SystemExit or os._exit(0) before the tests run is a failure, not a pass.

What it is NOT: a security boundary. The code runs as the same user with full filesystem and network access
through every path we did not stub (open(), ctypes, socket, ...), and code that sets out to can find the
token in the runner's memory (gc, frames) or re-import a fresh copy of a stubbed builtin module. The guard stops
the *accidental* damage a buggy completion can do (rm -rf a directory, fork-bomb, fill the disk, eat all RAM)
and the accidental or learned early exit; do not run code from an adversary with it. For that, use a
container or VM without network and with a read-only filesystem.
"""

import os
import secrets
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

MEMORY_ERROR_EXIT = 86  # the runner exits with this when the code ran out of memory (MemoryError)
SYSTEM_EXIT_EXIT = 87  # the runner exits with this when the code raised SystemExit (exit(), sys.exit(...))
MAX_OUTPUT_BYTES = 1 << 20  # keep at most this much of stdout / stderr

# The runner: a small script the subprocess executes. It applies the limits and the guard, then runs the
# code with __name__ == "__main__". The limits are set in the child itself (not via preexec_fn, which is
# unsafe in a parent that has threads, as any process running torch does).
_RUNNER = r'''
import builtins, os, resource, shutil, signal, subprocess, sys, traceback

def _disabled(name):
    def stub(*args, **kwargs):
        raise PermissionError(f"{name} is disabled in the nanochat execution sandbox")
    return stub

_OS_NAMES = ["system", "kill", "killpg", "remove", "removedirs", "rmdir", "unlink", "rename",
    "renames", "replace", "truncate", "ftruncate", "chdir", "fchdir", "chmod", "fchmod", "lchmod", "chown",
    "fchown", "lchown", "chroot", "link", "symlink", "setuid", "setgid", "seteuid", "setegid", "setreuid",
    "setregid", "setresuid", "setresgid", "fork", "forkpty", "vfork", "execv", "execve", "execl", "execle",
    "execlp", "execlpe", "execvp", "execvpe", "spawnv", "spawnve", "spawnl", "spawnle", "spawnlp",
    "spawnlpe", "spawnvp", "spawnvpe", "posix_spawn", "posix_spawnp", "popen", "startfile", "plock"]

def _install_guard():
    # os re-exports the functions of posix (nt on Windows): stub both, or `import posix; posix.unlink` gets past
    stubs = [(os, _OS_NAMES), (shutil, ["rmtree", "move", "chown"]),
             (subprocess, ["Popen", "run", "call", "check_call", "check_output", "getoutput", "getstatusoutput",
                           "_fork_exec"]),
             (signal, ["pidfd_send_signal"])]
    for name in ["posix", "nt"]:
        if sys.modules.get(name) is not None:
            stubs.append((sys.modules[name], _OS_NAMES))
    if sys.modules.get("_posixsubprocess") is not None:  # subprocess imported it; stub the shared module object
        stubs.append((sys.modules["_posixsubprocess"], ["fork_exec"]))
    for mod, names in stubs:
        for name in names:
            if hasattr(mod, name):
                setattr(mod, name, _disabled(f"{mod.__name__}.{name}"))
    builtins.help = _disabled("help")  # help() would try to start a pager
    # modules that could undo the limits or spawn workers
    for name in ["resource", "psutil", "multiprocessing", "ctypes", "_ctypes", "pty", "tkinter", "ipdb", "joblib",
                 "_posixsubprocess", "_multiprocessing", "_posixshmem"]:
        sys.modules[name] = None

def _flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass

def _main():
    code_path, token_path, marker_path = sys.argv[1:4]
    mem_bytes, cpu_seconds, fsize_bytes, exit_on_oom, exit_on_exit = map(int, sys.argv[4:9])
    with open(code_path, encoding="utf-8") as f:
        source = f.read()
    # the per-run token: read it and delete the file before the code runs, so the code cannot read it back
    with open(token_path, encoding="ascii") as f:
        token = f.read().strip().encode("ascii")
    os.unlink(token_path)
    if mem_bytes > 0 and sys.platform != "darwin":
        resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))
        resource.setrlimit(resource.RLIMIT_DATA, (mem_bytes, mem_bytes))
    if cpu_seconds > 0:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_bytes, fsize_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # what the runner needs after the code ran, taken before the code can rebind or stub it
    _open, _write, _close, _exit = os.open, os.write, os.close, os._exit
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    _install_guard()
    try:
        exec(compile(source, "<generated>", "exec"), {"__name__": "__main__", "__builtins__": builtins})
    except MemoryError:
        sys.stderr.write("MemoryError: the code exceeded the sandbox memory limit\n")
        sys.stderr.flush()
        _exit(exit_on_oom)
    except SystemExit as e:
        _flush()
        msg = f"SystemExit: the program called exit({e.code!r}) before it ran to its end, which counts as a failure\n"
        try:
            _write(2, msg.encode("utf-8", errors="replace"))
        except OSError:
            pass
        _exit(exit_on_exit)
    except BaseException as e:
        # drop the runner's own frame so the traceback starts in the generated code
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        _flush()
        _exit(1)  # not sys.exit: the code's atexit handlers must not turn this into another status
    # the code returned normally: flush what it printed, then leave the completion marker
    _flush()
    fd = _open(marker_path, flags, 0o600)
    _write(fd, token)
    _close(fd)

_main()
'''


@dataclass
class ExecutionResult:
    success: bool  # ran to its end (completion marker written) and exited with status 0 within the limits
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


def _read_capped(path, limit=MAX_OUTPUT_BYTES):
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    text = data[:limit].decode("utf-8", errors="replace")
    return text + ("\n[output truncated]" if len(data) > limit else "")


def execute_code(code, timeout=5.0, maximum_memory_bytes=256 * 1024 * 1024, max_output_bytes=MAX_OUTPUT_BYTES):
    """
    Run `code` (a Python program as a string) in the sandbox and return an ExecutionResult.
    timeout: wall-clock seconds; maximum_memory_bytes: address-space cap (None or 0 disables it).
    """
    if timeout is None or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    mem = int(maximum_memory_bytes or 0)
    # CPU cap: a backstop in case the wall clock kill fails; a tight loop uses ~1 CPU second per second
    cpu = int(timeout) + 2
    with tempfile.TemporaryDirectory(prefix="nanochat_exec_") as workdir:
        code_path = os.path.join(workdir, "program.py")
        runner_path = os.path.join(workdir, "runner.py")
        token_path, marker_path = os.path.join(workdir, ".nanochat_token"), os.path.join(workdir, ".nanochat_done")
        token = secrets.token_hex(16)
        fd = os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(token)
        out_path, err_path = os.path.join(workdir, "stdout.txt"), os.path.join(workdir, "stderr.txt")
        with open(code_path, "w", encoding="utf-8") as f:
            f.write(code)
        with open(runner_path, "w", encoding="utf-8") as f:
            f.write(_RUNNER)
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
        # the file cap covers everything the program writes, stdout/stderr included; a bit over what we read back
        fsize = max_output_bytes * 4 + 4096
        cmd = [sys.executable, "-I", runner_path, code_path, token_path, marker_path,
               str(mem), str(cpu), str(fsize), str(MEMORY_ERROR_EXIT), str(SYSTEM_EXIT_EXIT)]
        timed_out = False
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True)
            try:
                returncode = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc)
                returncode = proc.wait()
        stdout, stderr = _read_capped(out_path, max_output_bytes), _read_capped(err_path, max_output_bytes)
        finished = _read_marker(marker_path) == token
    memory_exceeded = returncode == MEMORY_ERROR_EXIT
    success = returncode == 0 and finished and not timed_out
    if timed_out:
        error = f"timed out after {timeout} s"
    elif memory_exceeded:
        error = f"memory limit exceeded ({mem} bytes)"
    elif returncode < 0:
        sig = -returncode
        error = f"killed by signal {signal.Signals(sig).name if sig in signal.valid_signals() else sig}"
        if sig == signal.SIGXCPU:
            timed_out, error = True, f"CPU time limit exceeded ({cpu} s)"
    elif returncode == SYSTEM_EXIT_EXIT:
        last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
        error = last if last.startswith("SystemExit: the program called exit(") else \
            "SystemExit: the program called exit() before it ran to its end"
    elif returncode != 0:
        last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
        error = last or f"exit status {returncode}"
    elif not finished:
        error = "the program exited (status 0) before it ran to its end, e.g. through os._exit()"
    else:
        error = None
    return ExecutionResult(success=success, stdout=stdout, stderr=stderr, error=error, timeout=timed_out,
                           memory_exceeded=memory_exceeded)


def _read_marker(path):
    try:
        with open(path, "rb") as f:
            return f.read(256).decode("ascii", errors="replace")
    except OSError:
        return None


def _kill_group(proc):
    # the child leads its own session, so its process group holds it and anything it managed to start
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
