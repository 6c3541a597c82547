"""
Runs a launch pipeline's steps (nanochat/launch/pipeline.py) in order, or in a dry run prints each one and runs none.

Every command is printed before it runs (`RUN: ...`, shell-quoted, so a line can be pasted back). A step that fails
stops the pipeline with the command's exit status, unless the step says otherwise: runcpu.sh's stages after the base
model are listed at the end (exit 1) while the others go on, a step with a fallback runs its fallback instead, and an
optional download only says it failed.

Stop signals: a SIGTERM/SIGUSR1 (a preemption notice; on Kubernetes-style platforms only the container's first process
gets it) or SIGINT/SIGHUP is passed on to the running command, which runs in its own session so it gets each signal
once; torchrun hands it to the ranks, a training stage finishes its step and saves. Then the pipeline stops with exit
status 128 + the signal, so the job is requeued and the next start resumes.
"""

import os
import shlex
import signal
import subprocess
import sys

FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)


def log(launcher, message, file=None):
    print(f"[{launcher}] {message}", file=file or sys.stdout, flush=True)


def banner(text, indent=""):
    print(f"\n{indent}\033[1m==> {text}\033[0m", flush=True)


class Runner:
    """Runs commands for one launcher (its name prefixes the log lines), in the environment `env`, with the stop
    signals passed on. In a dry run it only prints them."""

    def __init__(self, name, dry_run, env=None, resume_hint=None):
        self.name, self.dry_run = name, dry_run
        # what the stop line says about running again: the launcher's own way (runcpu.sh's stages start over)
        self.resume_hint = resume_hint or "the same command continues from the latest checkpoint (--resume_from_step=auto)"
        self.env = dict(os.environ if env is None else env)  # the commands' environment; steps may add to it
        self.children, self.stopped = [], None
        self.background = {}  # step name -> (process, argv) of a step started in the background
        self.failed = []  # the steps that failed while the pipeline went on (runcpu.sh's stages after the base model)
        if not dry_run:
            for sig in FORWARDED:
                signal.signal(sig, self._forward)

    def _forward(self, signum, frame):
        if self.stopped:  # one notice is enough: a second one could cut short the checkpoint being written
            return
        self.stopped = signum
        for child in self.children:
            if child.poll() is None:
                child.send_signal(signum)

    def check_stop(self):
        if self.stopped:
            name = signal.Signals(self.stopped).name
            log(self.name, f"stopped by {name} (a training stage that was running saved its step first); {self.resume_hint}")
            for child in self.children:
                if child.poll() is None:
                    child.terminate()
            sys.exit(128 + self.stopped)

    def start(self, argv, cwd=None):
        """Start argv in the background (None in a dry run)."""
        self.check_stop()
        if self.dry_run:
            return None
        child = subprocess.Popen(argv, env=self.env, cwd=cwd, start_new_session=True)
        self.children.append(child)
        return child

    def finish(self, child):
        """Wait for a started command: its exit status (0 in a dry run). A signal runs _forward meanwhile."""
        rc = 0 if child is None else child.wait()
        self.check_stop()
        return rc

    def call(self, argv, shown=None, cwd=None):
        """Print and run argv: its exit status. `shown` replaces the printed form (a shell pipeline run by bash)."""
        self.check_stop()
        print(f"RUN: {shown or shlex.join(argv)}", flush=True)
        return self.finish(self.start(argv, cwd))

    def fail(self, rc, argv):
        log(self.name, f"error: exit status {rc} from {shlex.join(argv)}")
        sys.exit(rc if 0 < rc < 256 else 1)

    def run(self, argv, shown=None, cwd=None):
        """call(), and stop the pipeline with the command's status when it fails."""
        rc = self.call(argv, shown, cwd)
        if rc:
            self.fail(rc, argv)

    # -----------------------------------------------------------------------------
    # the steps of a pipeline

    def step(self, step, indent=""):
        """Run one Step (nanochat/launch/pipeline.py); in a dry run print it, and the fallback it would run instead."""
        self.check_stop()
        reason = step.skip() if step.skip else None
        if reason:
            log(self.name, reason)
            return
        if step.banner:
            banner(step.banner, indent)
        if step.wait:  # a command started in the background: wait for it now
            child, argv = self.background.pop(step.wait)
            if child is not None:
                print(step.show, flush=True)
            rc = self.finish(child)
            if rc:
                self.fail(rc, argv)
            return
        verb = "RUN (in the background)" if step.background else step.verb
        if verb and (verb != "CHECK" or self.dry_run):  # a check speaks for itself when it runs
            print(f"{indent}{verb}: {step.show or shlex.join(step.argv)}", flush=True)
        if step.background:
            self.background[step.name] = (self.start(step.argv), step.argv)
            return
        if self.dry_run:
            if step.fallback:
                print(f"{indent}  if that fails:", flush=True)
                for alt in step.fallback:
                    self.step(alt, indent + "  ")
            return
        if step.do is not None:
            step.do(self)
            return
        rc = self.finish(self.start(step.argv))
        if rc == 0:
            return
        if step.fallback:
            for alt in step.fallback:
                self.step(alt)
        elif step.verb == "CHECK":  # the check printed what is wrong and the fix
            sys.exit(1)
        elif step.failure == "continue":
            print(f'\n\033[31m!!! stage "{step.name}" failed (exit {rc}): see its messages above\033[0m', flush=True)
            self.failed.append(step.name)
        elif step.failure == "note":
            print(step.note, flush=True)
        elif step.note:
            print(step.note, file=sys.stderr, flush=True)
            sys.exit(rc if 0 < rc < 256 else 1)
        else:
            self.fail(rc, step.argv)


def run_pipeline(pipeline, dry_run):
    """Run a Pipeline: its setup, then (the base dir made) its steps; its exit status."""
    runner = Runner(pipeline.launcher, dry_run, pipeline.env, pipeline.resume_hint)
    if dry_run:
        log(pipeline.launcher, "dry run: printing the commands, running nothing")
    if pipeline.bootstrap:  # a fresh machine's setup: checks first, says what it does, in a dry run only prints it
        pipeline.bootstrap(runner)
    for step in pipeline.setup:
        runner.step(step)
    if not dry_run:
        os.makedirs(pipeline.base_dir, exist_ok=True)  # every node makes its own base dir (node-local or not)
    for step in pipeline.steps:
        runner.step(step)
    if runner.failed:
        print(f"\n\033[31mThese stages did not complete: {','.join(runner.failed)}\033[0m", flush=True)
        print(pipeline.failed_hint, flush=True)
        return 1
    print(pipeline.done, flush=True)
    return 0
