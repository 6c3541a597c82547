"""
Run untrusted, model-generated Python (HumanEval completions) inside a sandbox built from the Linux kernel, and
grade it with a verdict the program cannot forge.

    result = execute_code("def f():\\n    return 1\\nassert f() == 1")   # ExecutionResult(success=True)
    result = check_function("def f(x):\\n    return 2 * x", "f", "def check(candidate):\\n    assert candidate(2) == 4")

This file is nanochat's side: the API and the orchestration. Each program runs in a fresh process tree started from
nanochat/sandbox.py (the sandboxed side, standard library only, run by path: `python -I sandbox.py CONFIG`), whose
docstring lists the layers: namespaces, rlimits, Landlock, seccomp. Here we start the runners, hand each its program
on stdin and its limits in CONFIG, read their output and reports, enforce the wall clock, and kill them and remove
their work dirs on every way out of execute_code, Ctrl-C included. Which layers this machine gives is detected once
(isolation()) and logged; execute_code refuses to run without at least the process + filesystem + network layers
unless called with unsafe=True (--unsafe_sandbox in the scripts).

Two verdicts, and what each one can be trusted for (the threat model, also in docs/sandbox.md):
- execute_code(program).success: P ended by the runner's own last step after the program's last line (status 0 and
  the runner's end mark, which L reads and reports: P does not hold the report pipe). An exception, exit(),
  os._exit(), the end of the main thread alone (SYS_exit), a signal, a timeout or the memory cap is a failure. This
  is P's account of itself: a program that sets out to lie (writes the end mark itself, then exits) can, because
  anything that runs in P can rewrite P. Use it for programs, not for grading.
- check_function(solution, entry_point, tests).success: the grading verdict (HumanEval, RL rewards). The solution
  runs in one sandbox (S); the tests run in another (C), where `candidate` is a stub that sends each call's
  arguments to S and gets the return value back as plain data only (None, bool, int, float, complex, str, bytes,
  list, tuple, dict, set, frozenset, iterators as iterators, builtin exceptions by name), parsed by C. success means
  C's check(candidate) returned, as L observed C's exit. Nothing S does reaches C: separate processes and pid
  namespaces, no signals or ptrace, no shared files or memory, and no object of S's (an __eq__ that is always True,
  a rewritten frame, a faked mark) crosses; S's only channel is its replies, which are data. So exiting early,
  killing, faking marks or patching the checker makes the calls fail, and a wrong answer stays wrong.
What the program can read: the system's libraries, the standard library and site-packages, nothing else (not the
project checkout, .git, home directories, the host's keys; the task data and the answer packages are hidden, so a
wrong answer cannot look its answer up). What neither verdict isolates: CPU and memory up to the limits. Kernel bugs
are out of scope.
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

from nanochat import sandbox
from nanochat.sandbox import MEMORY_ERROR_EXIT, SYSTEM_EXIT_EXIT

logger = logging.getLogger(__name__)

RUNNER = os.path.abspath(sandbox.__file__)  # the sandboxed side, run by path (never imported by the runner)

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
    success: bool  # execute_code: the program ran to its end; check_function: the tests passed
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
# The caller's side: start the runners, collect their output and reports, enforce the wall clock


def execute_code(code, timeout=5.0, maximum_memory_bytes=256 * 1024 * 1024, max_output_bytes=MAX_OUTPUT_BYTES,
                 disk_bytes=DISK_BYTES, unsafe=False):
    """
    Run `code` (a Python program as a string) in the sandbox and return an ExecutionResult; success means the program
    ran to its end (its own account: see the module docstring; grade with check_function).
    timeout: wall-clock seconds; maximum_memory_bytes: address-space cap (None or 0 disables it);
    disk_bytes: total size of the files it may write; unsafe: run even without the REQUIRED_LAYERS.
    """
    limits = _limits(timeout, maximum_memory_bytes, max_output_bytes, disk_bytes)
    require_isolation(unsafe)
    [run] = _run_all([_Spec(code, "program")], limits, required=[] if unsafe else list(REQUIRED_LAYERS))
    return _result(run, limits)


def check_function(solution, entry_point, tests, context="", timeout=5.0, maximum_memory_bytes=256 * 1024 * 1024,
                   max_output_bytes=MAX_OUTPUT_BYTES, disk_bytes=DISK_BYTES, unsafe=False):
    """
    Grade `solution` (untrusted code that defines the function `entry_point`) with `tests` (trusted code that defines
    check(candidate) and asserts on what candidate returns), each in its own sandbox (see the module docstring).
    context: trusted code run before the tests, e.g. the helpers of a HumanEval prompt that the tests call.
    success: check(candidate) returned. stdout/stderr are the solution's, then the tests' stderr; the limits apply to
    each sandbox and the timeout to the whole.
    """
    limits = _limits(timeout, maximum_memory_bytes, max_output_bytes, disk_bytes)
    require_isolation(unsafe)
    calls_r, calls_w = os.pipe()  # tests -> solution: the arguments of each call
    replies_r, replies_w = os.pipe()  # solution -> tests: the return value (or exception) of each call
    tests_source = f"{context}\n\n{tests}\n"
    specs = [_Spec(solution, "serve", (calls_r, replies_w), entry_point),
             _Spec(tests_source, "check", (replies_r, calls_w), entry_point)]
    solved, checked = _run_all(specs, limits, required=[] if unsafe else list(REQUIRED_LAYERS))
    result = _result(checked, limits)
    solution_result = _result(solved, limits)
    if not result.success and not result.timeout and "exit" in solved.report and not solved.ended:
        # the calls failed because the solution's process was gone: say why it went
        result.error = f"{result.error} (the solution: {solution_result.error})"
    result.stdout = solution_result.stdout
    result.stderr = solution_result.stderr + result.stderr
    result.memory_exceeded = result.memory_exceeded or (not result.success and solution_result.memory_exceeded)
    return result


def _limits(timeout, maximum_memory_bytes, max_output_bytes, disk_bytes):
    if timeout is None or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    # cpu: a backstop in case the wall clock kill fails; a tight loop uses ~1 CPU s per s
    return {"timeout": timeout, "mem": int(maximum_memory_bytes or 0), "cpu": int(timeout) + 2,
            "output": max_output_bytes, "disk": int(disk_bytes)}


def isolation():
    """The layers this machine gives the sandbox, detected once by running an empty program; logged once."""
    global _ISOLATION
    with _ISOLATION_LOCK:
        if _ISOLATION is None:
            limits = _limits(30.0, 256 << 20, 4096, 1 << 20)
            [run] = _run_all([_Spec("pass", "program")], limits, required=[])
            result = _result(run, limits)
            if not result.success:
                raise SandboxUnavailable(f"the sandbox runner failed to start: {result.error}\n{result.stderr}")
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
            f"{UNSAFE_HINT}. Linux >= 5.13 with Landlock and seccomp gives all three (see docs/sandbox.md).")
    return layers


@dataclass
class _Spec:
    source: str
    mode: str  # "program" (execute_code), "serve" (check_function's solution), "check" (its tests)
    rpc: tuple = ()  # (read fd, write fd) of the calls between "serve" and "check"
    entry_point: str = ""


@dataclass
class _Run:
    """What the caller saw of one runner: the exit status of L, stdout, stderr and L's report."""
    returncode: int
    stdout: bytes
    stderr: bytes
    report: dict
    timed_out: bool

    @property
    def layers(self):
        return self.report.get("layers", frozenset())

    @property
    def ended(self):  # P reached the runner's last step (status 0 and the end mark)
        return self.report.get("exit") == 0 and self.report.get("end", False)


def _run_all(specs, limits, required):
    """Start one runner per spec, read them all until they end or the wall clock runs out, kill and clean up on every
    way out (an exception or Ctrl-C here included)."""
    started = []
    try:
        try:
            for spec in specs:
                started.append(_start(spec, limits, required))
        finally:  # the runners hold the call pipes now: ours would keep a dead peer's pipe open
            for spec in specs:
                for fd in spec.rpc:
                    os.close(fd)
        outputs, timed_out = _collect(started, limits["timeout"], limits["output"])
    finally:
        for proc, report_r, report in started:
            _kill(proc, report)
            proc.wait()
            for stream in (proc.stdout, proc.stderr):
                stream.close()
            os.close(report_r)
            workdir = _parse_report(report).get("workdir")
            if workdir is not None:  # L removes it too, but not when it is killed
                shutil.rmtree(workdir, ignore_errors=True)
    return [_Run(proc.returncode, out, err, _parse_report(report), late)
            for (proc, _, report), (out, err), late in zip(started, outputs, timed_out)]


def _start(spec, limits, required):
    # L makes the work dir (and reports it): a caller killed before L exists leaves nothing behind
    report_r, report_w = os.pipe()
    config = {"tmp_root": tempfile.gettempdir(), "report_fd": report_w, "mem": limits["mem"], "cpu": limits["cpu"],
              "disk": limits["disk"], "fsize": limits["disk"], "nofile": MAX_OPEN_FILES, "required": required,
              "mode": spec.mode, "rpc": list(spec.rpc), "entry_point": spec.entry_point, "caller": os.getpid(),
              "hidden": _hidden_paths()}
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}  # + HOME and TMPDIR: the work dir
    # no native thread pools: they would count against the memory cap and outlive the program's last line
    env.update(dict.fromkeys(["OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"], "1"))
    try:
        with tempfile.TemporaryFile() as source:  # the program reaches the runner as its stdin, then is gone
            source.write(spec.source.encode("utf-8", errors="surrogatepass"))
            source.seek(0)
            proc = subprocess.Popen([sys.executable, "-I", RUNNER, json.dumps(config)],
                                    cwd=config["tmp_root"], env=env, stdin=source, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, pass_fds=(report_w, *spec.rpc), start_new_session=True)
    except BaseException:
        os.close(report_r)
        raise
    finally:
        os.close(report_w)
    return proc, report_r, bytearray()


def _hidden_paths():
    """What the program must not read even where it lies inside a tree it reads (a checkout in /usr/src, data in
    /usr/share): this project's checkout and ../shared/data beside it, the task data and base dirs, the HF caches.
    (Elsewhere nothing of the user's is readable in the first place: see sandbox._readable_rules.)"""
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [checkout, os.path.join(os.path.dirname(checkout), "shared", "data")] \
        if os.path.isfile(os.path.join(checkout, "pyproject.toml")) else []  # not an installed package's dir
    names = ["NANOCHAT_BASE_DIR", "NANOCHAT_DATA_DIR", "HF_HOME", "HF_DATASETS_CACHE", "HF_HUB_CACHE"]
    return paths + [os.path.abspath(os.path.expanduser(os.environ[name])) for name in names if os.environ.get(name)]


def _collect(started, timeout, limit):
    """Read every runner's stdout, stderr and report until all close; past the deadline, kill the sandboxes. The
    last runner gives the verdict: once it is done, the others have nothing left to do and are killed.
    Returns [(stdout, stderr)] and [timed out] per runner."""
    sel = selectors.DefaultSelector()
    kept, open_fds = {}, [3] * len(started)
    for i, (proc, report_r, report) in enumerate(started):
        for fd, buf, cap in ((proc.stdout.fileno(), bytearray(), limit), (proc.stderr.fileno(), bytearray(), limit),
                             (report_r, report, 65536)):
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ, (buf, cap, i))
            kept[fd] = buf
    deadline = time.monotonic() + timeout
    timed_out = [False] * len(started)
    while sel.get_map():
        left = deadline - time.monotonic()
        if left <= 0 and not any(timed_out):
            for i, (proc, _, report) in enumerate(started):
                timed_out[i] = open_fds[i] > 0
                _kill(proc, report)
            deadline = time.monotonic() + 10.0  # what is left in the pipes comes out right after the kill
            left = 10.0
        elif left <= 0:
            break  # something outside the sandbox holds a pipe open: stop reading, keep what we have
        for key, _ in sel.select(timeout=left):
            buf, cap, i = key.data
            try:
                data = os.read(key.fd, 65536)
            except BlockingIOError:
                continue
            if not data:
                sel.unregister(key.fd)
                open_fds[i] -= 1
                if i == len(started) - 1 and open_fds[i] == 0:
                    for proc, _, report in started[:-1]:
                        _kill(proc, report, program_only=True)
                continue
            buf += data[:max(0, cap + 1 - len(buf))]
    sel.close()
    outputs = [(kept[proc.stdout.fileno()], kept[proc.stderr.fileno()]) for proc, _, _ in started]
    return outputs, timed_out


def _parse_report(report):
    """L's report: "workdir PATH", "pid N", "layers a,b", "refused why", then "exit N" or "signal N", and "end" if P
    wrote its mark."""
    parsed = {}
    for line in bytes(report).decode("utf-8", errors="surrogateescape").splitlines():
        key, _, value = line.partition(" ")
        if key == "workdir" and "workdir" not in parsed:
            parsed["workdir"] = value
        elif key in ("pid", "exit", "signal") and value.lstrip("-").isdigit():
            parsed[key] = int(value)
        elif key == "layers":
            parsed["layers"] = frozenset(value.split(","))
        elif key == "refused":
            parsed["refused"] = value
        elif key == "end":
            parsed["end"] = True
    return parsed


def _kill(proc, report, program_only=False):
    # P is pid 1 of the sandbox's pid namespace: killing it ends everything inside. Without a pid namespace,
    # seccomp keeps the program from starting processes, and L's process group is all there is. program_only: kill
    # P alone, and L still reports how P ended (it may have exited on its own a moment before).
    if proc.poll() is not None:
        return  # L waited for P before it exited, so P is gone too
    parsed = _parse_report(report)
    if "exit" in parsed or "signal" in parsed:
        return  # L has reaped P and is about to exit
    pid = parsed.get("pid")
    targets = [(os.kill, pid)] + ([] if program_only and pid is not None else [(os.killpg, proc.pid)])
    for kill, target in targets:
        if target is not None:
            try:
                kill(target, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _text(data, limit):
    text = bytes(data[:limit]).decode("utf-8", errors="replace")
    return text + ("\n[output truncated]" if len(data) > limit else "")


def _result(run, limits):
    r = run.report
    stdout, stderr = _text(run.stdout, limits["output"]), _text(run.stderr, limits["output"])
    memory_exceeded = r.get("exit") == MEMORY_ERROR_EXIT
    timed_out = run.timed_out
    last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if timed_out:
        error = f"timed out after {limits['timeout']} s"
    elif "refused" in r:
        error = f"the sandbox refused to run the code: {r['refused']}"
    elif "signal" in r:
        sig = r["signal"]
        error = f"killed by signal {signal.Signals(sig).name if sig in signal.valid_signals() else sig}"
        if sig in (signal.SIGXCPU, signal.SIGKILL):  # RLIMIT_CPU: SIGXCPU, then SIGKILL (pid 1 ignores SIGXCPU)
            timed_out, error = True, f"CPU time limit exceeded ({limits['cpu']} s)"
    elif "exit" not in r or run.returncode != 0:
        error = f"the sandbox runner failed (exit status {run.returncode}): {last}"
    elif memory_exceeded:
        error = f"memory limit exceeded ({limits['mem']} bytes)"
    elif r["exit"] == SYSTEM_EXIT_EXIT:
        error = last if last.startswith("SystemExit: the program called exit(") else \
            "SystemExit: the program called exit() before it ran to its end"
    elif r["exit"] != 0:
        error = last or f"exit status {r['exit']}"
    elif not run.ended:
        error = "the program exited (status 0) before it ran to its end, e.g. through os._exit()"
    else:
        error = None
    return ExecutionResult(success=error is None, stdout=stdout, stderr=stderr, error=error, timeout=timed_out,
                           memory_exceeded=memory_exceeded)
