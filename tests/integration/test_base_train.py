"""base_train end to end on CPU: flags, exact resume, learning, schedules and batch arithmetic."""

import pytest
import torch

from nanochat import batching, training
from nanochat.checkpoint import resume, train_state
from nanochat.checkpoint_manager import load_checkpoint
from nanochat.configurator import FlagError, parse_flags
from nanochat.metrics import read_metrics

TINY = ["--depth=1", "--max_seq_len=64", "--device_batch_size=4", "--total_batch_size=512", "--eval_every=4",
        "--eval_tokens=1024", "--core_metric_every=-1", "--sample_every=-1", "--device_type=cpu"]


def run_base_train(argv, capsys):
    from scripts import base_train

    out = base_train.main(argv)
    text = capsys.readouterr().out
    return out, text


def step_losses(base_dir, tag):
    """{step: train/loss} from the run's metrics.jsonl."""
    records = read_metrics(base_dir / "base_checkpoints" / tag / "metrics.jsonl")
    return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}


def test_flags_forms_and_errors():
    d = {"depth": 20, "device_batch_size": 32, "use_muon": True, "matrix_lr": 0.02, "run": "dummy"}
    c = parse_flags(d, ["--depth=4", "--device-batch-size", "8", "--use_muon=0", "--matrix-lr=1e-3", "--run", "x"])
    assert c == {"depth": 4, "device_batch_size": 8, "use_muon": False, "matrix_lr": 1e-3, "run": "x"}
    with pytest.raises(FlagError, match="Did you mean: --depth"):
        parse_flags(d, ["--dept=4"])
    with pytest.raises(FlagError, match="expects an integer"):
        parse_flags(d, ["--depth=four"])


def test_batch_arithmetic_suggests_valid_values():
    assert batching.batch_arithmetic(4096, 4, 64, 2) == (8, 512)
    with pytest.raises(ValueError, match=r"--total_batch_size=4096 or 4608"):
        batching.batch_arithmetic(4100, 4, 64, 2)
    with pytest.raises(ValueError, match=r"Use --total_batch_size=512 or --device_batch_size in \[1, 2\]\.$"):
        batching.batch_arithmetic(256, 4, 64, 2)  # below one forward/backward: one value to use, not "512 or 512"


def test_schedules():
    assert training.lr_multiplier(0, 100, warmup_ratio=0.1) == pytest.approx(0.1)
    assert training.lr_multiplier(50, 100) == 1.0
    assert training.lr_multiplier(100, 100, warmdown_ratio=0.2, final_lr_frac=0.0) == 0.0
    assert training.lr_multiplier(90, 100, warmdown_ratio=0.2, final_lr_frac=0.1) == pytest.approx(0.5 + 0.5 * 0.1)
    assert training.muon_momentum(0) == pytest.approx(0.85) and training.muon_momentum(300) == pytest.approx(0.95)
    assert training.muon_momentum(150) == pytest.approx(0.90)
    # a period <= 0 turns an action off entirely, also at the last step (nanochat's `step % -1 == 0` bug)
    assert not training.every(5, -1, last_step=True) and not training.every(0, 0)
    assert training.every(0, 3) and training.every(6, 3) and not training.every(7, 3) and training.every(7, 3, last_step=True)


def test_bad_total_batch_stops_with_message(base_dir, capsys):
    from scripts import base_train

    with pytest.raises(ValueError, match="not divisible"):
        base_train.main(TINY[:3] + ["--total_batch_size=1000", "--num_iterations=1", "--device_type=cpu"])


@pytest.mark.slow  # two training runs
def test_resume_is_exact(base_dir, capsys):
    """2N steps uninterrupted == N steps, resume, N steps: identical losses and parameters (Muon + AdamW)."""
    n = 4
    full, full_text = run_base_train(TINY + [f"--num_iterations={2 * n}", "--model_tag=full", f"--save_every={n}"], capsys)
    # the interruption: a fresh tag holding only the step-N checkpoint files, resumed by a new run
    import shutil

    src = base_dir / "base_checkpoints" / "full"
    dst = base_dir / "base_checkpoints" / "resumed"
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f"{n:06d}" in f.name:
            shutil.copy(f, dst / f.name)
    resumed, resumed_text = run_base_train(TINY + [f"--num_iterations={2 * n}", "--model_tag=resumed", f"--resume_from_step={n}"], capsys)

    full_losses, resumed_losses = step_losses(base_dir, "full"), step_losses(base_dir, "resumed")
    assert sorted(full_losses) == list(range(1, 2 * n + 1))
    assert sorted(resumed_losses) == list(range(n + 1, 2 * n + 1))  # the copied files held no metrics.jsonl
    for s in range(n + 1, 2 * n + 1):
        assert resumed_losses[s] == full_losses[s], f"step {s}: {resumed_losses[s]} != {full_losses[s]}"
    assert resumed["val_bpb"] == full["val_bpb"]
    a, _, _ = load_checkpoint(str(src), 2 * n, "cpu", load_optimizer=True)
    b, _, _ = load_checkpoint(str(dst), 2 * n, "cpu", load_optimizer=True)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def ddp():
    """The single-process DDP plan, bound to its one rank."""
    from nanochat.distributed.parallel import parallel_from_config

    return parallel_from_config({}, rank=0, world=1)


def test_resume_refuses_other_parallelism_path(tmp_path):
    """Optimizer state differs between the DDP and FSDP paths: resuming across them is a clear error, not a crash."""
    from nanochat.gpt import GPTConfig
    from nanochat.distributed.parallel import FSDP, DataParallel

    model = training.init_model(GPTConfig(sequence_len=16, vocab_size=64, n_layer=1, n_head=1, n_kv_head=1, n_embd=64), "cpu")
    optimizers = model.setup_optimizers()
    train_state.save_train_state(str(tmp_path), 3, model, optimizers, {"user_config": {"use_fsdp": False}}, None, ddp())
    _, _, meta = load_checkpoint(str(tmp_path), 3, "cpu")
    assert meta["parallel"] == "ddp"
    with pytest.raises(ValueError, match="resume with --use_fsdp=0"):
        train_state.load_train_state(str(tmp_path), 3, model, optimizers, "cpu", FSDP())
    train_state.load_train_state(str(tmp_path), 3, model, optimizers, "cpu", ddp())
    # checkpoints from before meta["parallel"] existed say it with their --use_fsdp flag
    with pytest.raises(ValueError, match="resume with --use_fsdp=1"):
        DataParallel().check_resume({"user_config": {"use_fsdp": True}}, 3)
    FSDP().check_resume({"user_config": {"use_fsdp": True}}, 3)


def test_resume_refuses_another_model_shape_and_a_meta_without_loop_state(tmp_path):
    """Resuming with another --depth names both shapes and the flag; a meta with no loop state names the file."""
    from nanochat.gpt import GPTConfig

    def cfg(n_layer):
        return GPTConfig(sequence_len=16, vocab_size=64, n_layer=n_layer, n_head=1, n_kv_head=1, n_embd=64)

    saved = training.init_model(cfg(2), "cpu")
    train_state.save_train_state(str(tmp_path), 3, saved, saved.setup_optimizers(),
                                 {"model_config": vars(cfg(2)), "user_config": {"depth": 2}}, None, ddp())
    other = training.init_model(cfg(1), "cpu")
    with pytest.raises(ValueError, match=r"holds a model with n_layer=2 but this run builds n_layer=1: resume with the "
                                         r"model flags of the run that saved it \(--depth=2\)"):
        train_state.load_train_state(str(tmp_path), 3, other, other.setup_optimizers(), "cpu", ddp())
    meta, _ = train_state.load_train_state(str(tmp_path), 3, saved, saved.setup_optimizers(), "cpu", ddp())
    with pytest.raises(ValueError, match=r"meta_000003.json has no loop state to resume from \(missing loop_state "
                                         r"meter\).*Its model still loads"):
        resume.resume_loop_state(meta, str(tmp_path), 3, ("meter",))
    assert resume.resume_loop_state({"loop_state": {"meter": 1}}, str(tmp_path), 3, ("meter",)) == {"meter": 1}


def test_resume_with_other_optimizers_names_the_file_and_the_flag(tmp_path):
    from nanochat.gpt import GPTConfig

    model = training.init_model(GPTConfig(sequence_len=16, vocab_size=64, n_layer=1, n_head=1, n_kv_head=1, n_embd=64), "cpu")
    train_state.save_train_state(str(tmp_path), 3, model, model.setup_optimizers(use_muon=True),
                                 {"user_config": {"use_muon": True}}, None, ddp())
    with pytest.raises(ValueError, match=r"optim_000003_rank0\.pt holds 2 optimizer states but this run built 1: resume "
                                         r"with the optimizer flags of the run that saved step 3 \(--use_muon=1\)"):
        train_state.load_train_state(str(tmp_path), 3, model, model.setup_optimizers(use_muon=False), "cpu", ddp())
    optimizers = model.setup_optimizers(use_muon=True)
    optimizers.reverse()  # same count, other parameter groups
    with pytest.raises(ValueError, match=r"optim_000003_rank0\.pt does not fit this run's .*--use_muon=1"):
        train_state.load_train_state(str(tmp_path), 3, model, optimizers, "cpu", ddp())


def test_parallel_strategy_from_flags():
    from nanochat.distributed.parallel import FSDP, DataParallel, parallel_from_config

    assert type(parallel_from_config({"use_fsdp": False})) is DataParallel
    assert type(parallel_from_config({})) is DataParallel  # scripts without FSDP flags (chat_rl)
    p = parallel_from_config({"use_fsdp": True, "fsdp_reduce_dtype": "bfloat16", "fsdp_defer_grad_sync": True})
    assert type(p) is FSDP and p.reduce_dtype == torch.bfloat16 and p.defer_grad_sync and p.collective_forward
    with pytest.raises(ValueError, match="needs --use_fsdp=1"):
        parallel_from_config({"use_fsdp": False, "fsdp_defer_grad_sync": True})
    with pytest.raises(ValueError, match="--fsdp_reduce_dtype must be float32 or bfloat16"):
        parallel_from_config({"use_fsdp": True, "fsdp_reduce_dtype": "fp8"})
    with pytest.raises(RuntimeError, match="launch with torchrun"):  # FSDP2 needs a process group
        FSDP().wrap(torch.nn.Linear(2, 2), "cpu")


def test_next_micro_batch_is_fetched_after_backward_is_queued():
    """The input pipeline off the critical path: each micro-batch is fetched after the previous backward was
    launched (not before the forward), and a MicroBatches kept across steps fetches the next step's first batch
    before the optimizer step. The losses are the same as fetching on demand."""
    from nanochat.gpt import GPTConfig
    from nanochat.distributed.parallel import DataParallel

    config = GPTConfig(sequence_len=16, vocab_size=64, n_layer=1, n_head=1, n_kv_head=1, n_embd=64)

    def run(across_steps, steps=2, accum=3):
        torch.manual_seed(0)
        model = training.init_model(config, "cpu")
        optimizers = model.setup_optimizers()
        events, taken = [], []
        for opt in optimizers:
            opt.step = (lambda step: lambda *a, **k: (events.append("opt"), step(*a, **k))[1])(opt.step)
        g = torch.Generator().manual_seed(1)

        def fetch():
            events.append("fetch")
            t = torch.randint(0, 64, (2, 17), generator=g)
            return t[:, :-1], t[:, 1:]

        def loss_fn(m, batch):
            loss = m(batch[0], batch[1])
            loss.register_hook(lambda grad: events.append("backward"))  # runs when backward starts
            return loss

        class Recorded(DataParallel):
            def after_optimizer_step(self, model):  # FSDP's FP8 scale precomputation hangs here
                events.append("after")

        source = training.MicroBatches(fetch, on_take=taken.append) if across_steps else fetch
        losses = [training.train_step(model, optimizers, source, accum, loss_fn=loss_fn, parallel=Recorded())[0]
                  for _ in range(steps)]
        return events, losses, taken

    events, losses, taken = run(across_steps=True)
    step = ["backward", "fetch"] * 3 + ["opt", "opt", "after"]
    assert events == ["fetch"] + step + step
    assert len(taken) == 6  # 7 fetched: on_take sees only what was trained on
    plain_events, plain_losses, _ = run(across_steps=False)
    # a plain callable: prefetch within the step only, so nothing is fetched that the step does not use
    step = ["fetch", "backward", "fetch", "backward", "fetch", "backward", "opt", "opt", "after"]
    assert plain_events == step + step
    assert losses == plain_losses  # bit-identical


def test_micro_batches_exhausted_source_errors_only_when_taken():
    it = iter([1, 2])
    mb = training.MicroBatches(lambda: (next(it),))
    assert mb.take() == (1,) and mb.take() == (2,)
    mb.prefetch()  # running out while prefetching is fine
    with pytest.raises(StopIteration):
        mb.take()
