"""
The skeleton every training stage runs in (base_train, mid_train, chat_sft; chat_rl takes the parts that fit), so each
script keeps only what is its own: its data, its model source, its loop body and its evaluations.

    stage = Stage(config, model_config=shape)              # stop signals, the parallel plan (its checks, bound to this
                                                           # rank), setup_run, --fp8 check
    model, orig_model = stage.prepare(model)               # AC -> FP8 -> TP -> FSDP -> compile (the plan's one call)
    optimizers = stage.optimizers(orig_model)              # the plan's optimizers with the stage's learning rates
    stage.open_log(checkpoint_dir, "nanochat-sft", resumed_step, user_config)  # metrics.jsonl/wandb; the loop begins
    meter = stage.start_meter(tokens_per_step, flops_per_token, num_iterations, saved_meter)
    for step in ...:
        if stage.stopping(step, start_step, checkpoint_dir, save): break  # a stop signal: saved, reported
        if stage.due(step, "eval_every", last_step):
            with stage.evaluating(orig_model): ...        # eval mode and autocast, train mode after
        loss, grad_norm, extras, dt = stage.timed_step(step, model, optimizers, batches, grad_accum, grad_clip)
        stage.log_step(step, loss, dt, lrm, {"train/grad_norm": grad_norm})
    stage.finish(section, data, curves)                    # report card, metrics closed, process group gone

Stop signals (nanochat/preemption.py): from Stage() until open_log a Ctrl-C/SIGTERM/SIGUSR1 ends the start-up with one
line (status 128 + the signal); in the loop it finishes the step and saves; Ctrl-C then exits with 130.

The pieces it calls live where they did: nanochat/training.py (setup_run, train_step, ProgressMeter, every),
nanochat/distributed/parallel.py (the plan), nanochat/checkpoint/resume.py, nanochat/metrics.py, nanochat/preemption.py.
"""

import contextlib
import os
import signal
import time

import torch

from nanochat.checkpoint.resume import resume_run
from nanochat.common import compute_cleanup, get_wandb, print0
from nanochat.distributed.dist import get_dist_info
from nanochat.distributed.parallel import parallel_from_config
from nanochat.metrics import MetricsLogger
from nanochat.preemption import StopSignal, stop_line
from nanochat.training import ProgressMeter, assert_finite, check_model_options, every, setup_run, train_step
from nanochat.usage import Interrupted


class Stage:
    """One training stage's run: where it runs, its parallel plan, its log, its meter and its stop signal."""

    def __init__(self, config, samples_alone=None, model_config=None):
        self.config = config
        self.metrics = self.meter = None
        # a stop signal from here to the loop ends the run with one line (nanochat/preemption.py); in the loop it is
        # a request to finish the step and save
        self.stop = StopSignal().install()
        try:
            # DDP, FSDP2 or FSDP2 x TP (nanochat/distributed/parallel.py) and which data this rank reads: its flags,
            # the world size and the model's shape (model_config: heads vs --tp_size) checked before any process group
            self.parallel = parallel_from_config(config, samples_alone=samples_alone)
            distributed, rank, _, world = get_dist_info()
            self.parallel.bind(rank, world)
            self.parallel.check_launch(model_config, world, distributed)
            self.ctx = setup_run(config)
            self.device, self.autocast, self.master = self.ctx.device, self.ctx.autocast, self.ctx.master
            self.rank, self.world_size = self.ctx.rank, self.ctx.world_size
            self.parallel.bind(self.rank, self.world_size, self.device.type)  # now the process group exists: the mesh
            check_model_options(config, self.device)  # --fp8=1 on hardware without FP8 stops here, before any work
        except BaseException:
            self.stop.uninstall()
            raise

    # ---------------------------------------------------------------- prologue

    def prepare(self, model):
        """(model to train, uncompiled model for eval, sampling and saving): the plan's prepare."""
        return self.parallel.prepare(model, self.config, self.device, self.autocast)

    def optimizers(self, model, **kwargs):
        """The plan's optimizers with the stage's --embedding_lr, --unembedding_lr, --matrix_lr, --weight_decay; kwargs
        add to or replace them (the record recipe's batch-scaled values, nanochat/recipe.py)."""
        c = self.config
        lrs = dict(unembedding_lr=c["unembedding_lr"], embedding_lr=c["embedding_lr"], matrix_lr=c["matrix_lr"],
                   weight_decay=c["weight_decay"])
        return self.parallel.setup_optimizers(model, **{**lrs, **kwargs})

    def resume(self, checkpoint_dir, model, optimizers, keys):
        """--resume_from_step: (start step, the saved loop state) after restoring model and optimizers, or (0, None)."""
        return resume_run(self.config, checkpoint_dir, model, optimizers, self.device, self.parallel, keys)

    def open_log(self, checkpoint_dir, project, resumed_step, user_config, run=None):
        """The metrics log (checkpoint_dir/metrics.jsonl, None = console only; wandb for --run), right before the
        loop: from here a stop signal finishes the step and saves (nanochat/preemption.py)."""
        wandb_run = get_wandb(run or self.config["run"], project, user_config, self.master)
        path = None if checkpoint_dir is None else os.path.join(checkpoint_dir, "metrics.jsonl")
        self.metrics = MetricsLogger(path, wandb_run, self.master, resumed_step)
        self.stop.training_started()
        return self.metrics

    def start_meter(self, tokens_per_step, flops_per_token, num_iterations, saved=None):
        """The step meter (EMA loss, tok/s, MFU, ETA), continued from a resumed run's saved state."""
        self.meter = ProgressMeter(tokens_per_step, flops_per_token, self.device, self.world_size, num_iterations)
        if saved is not None:
            self.meter.load_state_dict(saved)
        return self.meter

    # ---------------------------------------------------------------- the loop

    def stopping(self, step, start_step, checkpoint_dir, save=None):
        """True when SIGTERM/SIGUSR1 asked the run to stop (every rank, same step): saved (when a step was trained
        since the start or resume; `save()` writes a resumable checkpoint) and reported. On Ctrl-C (SIGINT) the run
        ends here once the step is saved: Interrupted, whose line says where and how to resume (status 130)."""
        if not self.stop.requested(self.device):
            return False
        saved = step > start_step and save is not None
        if saved:
            save()
        line = stop_line(step, checkpoint_dir, self.stop.agreed, saved, saves=save is not None)
        if self.stop.agreed == "SIGINT":
            self.close()
            raise Interrupted(line, signal.SIGINT)
        print0(line)
        return True

    def due(self, step, flag, last_step=False, at_last=True):
        """The periodic action of --<flag> (e.g. eval_every) is due at this step (<= 0 turns it off)."""
        return every(step, self.config[flag], last_step, at_last)

    @contextlib.contextmanager
    def evaluating(self, model):
        """Eval mode and the compute dtype's autocast for an evaluation or sampling; train mode again after."""
        model.eval()
        try:
            with self.autocast():
                yield model
        finally:
            model.train()

    def timed_step(self, step, model, optimizers, batches, grad_accum, grad_clip, loss_fn=None):
        """One optimisation step (training.train_step), timed to its end on the device: (loss, grad norm, extras, dt)."""
        t0 = time.time()
        loss, grad_norm, extras = train_step(model, optimizers, batches, grad_accum, grad_clip, self.autocast,
                                             loss_fn=loss_fn, parallel=self.parallel)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.time() - t0
        assert_finite(loss, step)
        return loss, grad_norm, extras, dt

    def log_step(self, step, loss, dt, lrm, extra=None, console="", mfu=True):
        """The step's line: the meter's fields, `extra` metrics between the learning rate and tok/s."""
        fields = self.meter.update(step, loss, dt)
        values = {"train/loss": fields["loss"], "train/raw_loss": loss, "train/lrm": lrm, **(extra or {}),
                  "train/tok_per_sec": fields["tok_per_sec"]}
        if mfu:
            values["train/mfu"] = fields["mfu"]
        self.metrics.log(step + 1, values, console=self.meter.format(step, fields, lrm, console))
        return fields

    # ---------------------------------------------------------------- wrap up

    def finish(self, section=None, data=None, curves=None):
        """The report card's section (rank 0; section None: none), the metrics closed, the process group torn down."""
        if self.master and section is not None:
            from nanochat.report import get_report

            report = get_report()
            self.metrics.log_curves(report, curves or {})
            report.log(section=section, data=data)
        self.close()

    def close(self):
        """The metrics closed, the stop signals back to what they were, the process group gone: finish() without the
        report, for a run that ends early (a stage already complete, a stop on Ctrl-C)."""
        if self.metrics is not None:
            self.metrics.finish()
        self.stop.uninstall()
        compute_cleanup()
