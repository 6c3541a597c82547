"""The HumanEval sandbox: results, timeouts, the memory cap, the disabled destructive calls, the environment."""

import os
import sys
import time

import pytest

from nanochat.execution import execute_code


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
    # the wrong answer still fails: the checks run (and fail) before any handler could exit
    r = execute_code("import atexit, os\natexit.register(os._exit, 0)\n" + WRONG_THEN_CHECK.format(exit="pass"))
    assert not r.success and "AssertionError: wrong answer" in r.error, r
    # a correct program that exits 0 from a thread still passes
    ok = execute_code("import threading, sys\nt = threading.Thread(target=sys.exit)\nt.start(); t.join()\nprint('ok')")
    assert ok.success and ok.stdout == "ok\n", ok


def test_passing_program_still_passes_and_the_marker_is_not_in_the_output(monkeypatch):
    r = execute_code("def f():\n    return 1\nassert f() == 1\nprint('checked', end='')")
    assert r.success and r.error is None and r.stdout == "checked" and r.stderr == "", r
    # the token file is gone before the code runs and argv / environment do not hold the token
    import nanochat.execution
    token = "f00d" * 8
    monkeypatch.setattr(nanochat.execution.secrets, "token_hex", lambda n: token)
    r = execute_code("import os, sys\nprint(sorted(os.listdir('.')))\nprint(sys.argv)\n"
                     "print(open('/proc/self/cmdline', 'rb').read())\nprint(open('/proc/self/environ', 'rb').read())")
    assert r.success, r
    assert ".nanochat_token" not in r.stdout.splitlines()[0] and ".nanochat_done" not in r.stdout.splitlines()[0]
    assert token not in r.stdout


def test_the_program_cannot_write_the_marker_itself():
    # without the per-run token, writing the marker file by hand and exiting early is still a failure
    r = execute_code("open('.nanochat_done', 'w').write('0' * 32)\nimport os\nos._exit(0)")
    assert not r.success and "before it ran to its end" in r.error, r


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
    # the cap is a cap, not a failure of everything: 16 MB under a 128 MB cap is fine
    ok = execute_code("x = bytearray(16 * 1024 * 1024)\nprint(len(x))", maximum_memory_bytes=cap)
    assert ok.success and ok.stdout == f"{16 * 1024 * 1024}\n"
    # and without the cap the same 1 GB allocation is not refused for memory reasons by us
    free = execute_code("x = bytearray(300 * 1024 * 1024)\nprint(len(x))", maximum_memory_bytes=None)
    assert free.success, free


@pytest.mark.parametrize("call", [
    "os.system('echo hacked')",
    "os.kill(os.getpid(), 9)",
    "os.fork()",
    "subprocess.run(['echo', 'hacked'])",
    "subprocess.Popen(['echo', 'hacked'])",
])
def test_process_calls_are_disabled(call):
    r = execute_code(f"import os, subprocess\n{call}")
    assert not r.success
    assert r.error.startswith("PermissionError") and "disabled in the nanochat execution sandbox" in r.error
    assert "hacked" not in r.stdout


def test_destructive_file_calls_are_disabled(tmp_path):
    victim_dir = tmp_path / "precious"
    victim_dir.mkdir()
    victim = victim_dir / "data.txt"
    victim.write_text("keep me")
    for call in [f"os.remove({str(victim)!r})", f"os.unlink({str(victim)!r})", f"shutil.rmtree({str(victim_dir)!r})",
                 f"os.rename({str(victim)!r}, {str(victim) + '.moved'!r})", f"shutil.move({str(victim)!r}, '/tmp/x')",
                 f"os.chmod({str(victim)!r}, 0)", f"os.truncate({str(victim)!r}, 0)"]:
        r = execute_code(f"import os, shutil\n{call}")
        assert not r.success and "PermissionError" in r.error, (call, r)
    assert victim.read_text() == "keep me"
    assert oct(victim.stat().st_mode & 0o777) != oct(0)


@pytest.mark.skipif(os.name != "posix", reason="the posix module")
def test_posix_module_bypass_is_blocked(tmp_path):
    victim = tmp_path / "data.txt"
    victim.write_text("keep me")
    flag = tmp_path / "ran.txt"
    for call in [f"import posix\nposix.unlink({str(victim)!r})", f"import posix\nposix.remove({str(victim)!r})",
                 f"import posix\nposix.rename({str(victim)!r}, {str(victim) + '.moved'!r})",
                 f"import posix\nposix.truncate({str(victim)!r}, 0)",
                 f"import posix\nposix.system('touch {flag}')",
                 f"import posix\nposix.posix_spawn('/usr/bin/touch', ['touch', {str(flag)!r}], {{}})",
                 f"import posix\nposix.execv('/usr/bin/touch', ['touch', {str(flag)!r}])",
                 "import posix\npid = posix.fork()\nprint('forked', pid)",
                 "import posix\nposix.kill(posix.getppid(), 0)",
                 f"import subprocess\nsubprocess._fork_exec(*[None] * 23)",
                 f"import os\nos.posix_spawnp('touch', ['touch', {str(flag)!r}], {{}})"]:
        r = execute_code(call)
        assert not r.success and r.error.startswith("PermissionError"), (call, r)
        assert "disabled in the nanochat execution sandbox" in r.error, (call, r)
        assert "forked" not in r.stdout
    assert victim.read_text() == "keep me"
    assert not flag.exists(), "a command ran"


@pytest.mark.parametrize("module", ["_posixsubprocess", "pty", "ctypes", "multiprocessing"])
def test_process_spawning_modules_are_unimportable(module):
    r = execute_code(f"import {module}\nprint('imported')")
    assert not r.success and r.error.startswith(("ImportError", "ModuleNotFoundError")), r
    assert "imported" not in r.stdout


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
    assert set(eval(names)) <= {"PATH", "HOME", "TMPDIR", "LANG", "LC_ALL", "LC_CTYPE"}


def test_no_stdin():
    t0 = time.time()
    r = execute_code("x = input()", timeout=5.0)
    assert not r.success and not r.timeout and r.error.startswith("EOFError")
    assert time.time() - t0 < 4.0


def test_output_is_capped():
    r = execute_code("import sys\nfor _ in range(200):\n    sys.stdout.write('y' * 100_000)", max_output_bytes=10_000)
    assert len(r.stdout) < 10_100 and r.stdout.endswith("[output truncated]")


def test_bad_timeout_is_rejected():
    with pytest.raises(ValueError, match="timeout"):
        execute_code("pass", timeout=0)
