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


def test_failed_assert_fails_and_sys_exit_zero_succeeds():
    assert not execute_code("assert 1 + 1 == 3").success
    assert execute_code("import sys\nprint('x')\nsys.exit(0)").success
    assert not execute_code("import sys\nsys.exit(3)").success


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
