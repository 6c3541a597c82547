"""
Communication per training step of the three distributed paths, and their CPU step times.

    python -m bench.dist_bench                 # analytic tables (d20, d40 on 8 ranks) + a measured 2-rank gloo run
    python -m bench.dist_bench --no_run        # analytic tables only (no processes launched)
    python -m bench.dist_bench --world=16 --depths=20,32,40

Paths:
  ddp        DistAdamW + DistMuon, no DDP wrapper: full fp32 params and grads on every rank; each optimizer step
             reduce-scatters the gradients and all-gathers the updated params (ZeRO-2), once per optimizer step
             whatever the gradient accumulation.
  fsdp_adamw FSDP2 (apply_fsdp) + torch AdamW on the shards: per fwd/bwd micro-step, all-gather params for forward
             and again for backward (every block but the last), reduce-scatter gradients.
  fsdp_muon  as fsdp_adamw, plus FSDPMuon's two all-to-alls of the matrix updates per optimizer step.
  tp2        FSDP2 x TP (apply_tp, --tp_size=2) + ShardedMuon: per block, 2 all-reduces of the (B, T, d) activations
             over the 2 tp ranks in forward and 2 in backward (+2 with activation checkpointing, which re-runs the
             forward); FSDP's all-gathers/reduce-scatters over the W/2 data ranks carry each rank's TP shard (1/2 of
             each block matrix); ShardedMuon's two all-to-alls over all W ranks per optimizer step.

Bytes are per rank sent per optimizer step under the usual ring/pairwise algorithms: all-reduce 2(W-1)/W * S,
reduce-scatter (W-1)/W * S_in, all-gather (W-1)/W * S_out, all-to-all (W-1)/W * S_in. The same formulas are checked
against a real run: the measured section patches torch.distributed's collectives, records every call of one training
step on 2 gloo ranks, and compares the byte totals with the analytic model of that small config.
"""

import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from nanochat.configurator import Flag, Flags  # noqa: E402
from nanochat.distributed.dist import compute_cleanup  # noqa: E402
from nanochat.presets import PRESETS  # noqa: E402
from nanochat.gpt import GPT, GPTConfig, config_for_depth  # noqa: E402

MODES = ("ddp", "fsdp_adamw", "fsdp_muon", "tp2")
TP = 2  # the tensor-parallel size of mode tp2
GiB = 1024**3


# -----------------------------------------------------------------------------
# the analytic model


def param_table(config):
    """[(name, shape, block index or None, is_muon_matrix)] of a GPT built on the meta device (no memory)."""
    with torch.device("meta"):
        model = GPT(config, attn="sdpa")
    rows = []
    for name, p in model.named_parameters():
        block = int(name.split(".")[2]) if name.startswith("transformer.h.") else None
        rows.append((name, tuple(p.shape), block, block is not None and p.ndim == 2))
    return rows


def padded_numel(shape, W):
    """Elements after padding dim 0 to a multiple of W (DistAdamW and FSDP2 both pad that way)."""
    return math.ceil(shape[0] / W) * W * math.prod(shape[1:])


def tp_local_shape(name, shape, tp):
    """The shape of one tp rank's shard: c_q/c_k/c_v/c_fc split by rows (column-wise), c_proj by columns (row-wise)."""
    if not name.startswith("transformer.h."):
        return shape  # wte, lm_head: replicated over tp
    if name.endswith("c_proj.weight"):
        return (shape[0], shape[1] // tp)
    return (shape[0] // tp, shape[1])


def comm_model(params, W, mode, grad_accum=1, param_bytes=2, reduce_bytes=4, master_bytes=4, ns_bytes=2,
               tokens=0, d_model=0, act_bytes=2, ac=False):
    """
    Analytic collectives of one optimizer step: {op: bytes (S_in for reduce-scatter/all-to-all, S_out for
    all-gather, the buffer for all-reduce)} and the per-rank bytes sent. param_bytes: FSDP's all-gather dtype;
    reduce_bytes: FSDP's reduce-scatter dtype; master_bytes: the fp32 params/grads of the DDP path; ns_bytes:
    FSDPMuon's/ShardedMuon's all-to-all dtype. tp2 only: tokens = B*T per rank per micro-step, d_model = n_embd,
    act_bytes = the compute dtype's size, ac = activation checkpointing on every block.
    """
    ops = {"all_gather": 0, "reduce_scatter": 0, "all_to_all": 0, "all_reduce": 0}
    if mode == "tp2":
        return _tp_comm_model(params, W, grad_accum, param_bytes, reduce_bytes, ns_bytes, tokens, d_model, act_bytes, ac)
    muon = [p for p in params if p[3]] if mode != "fsdp_adamw" else []
    adam = [p for p in params if p not in muon]
    if mode == "ddp":
        for _, shape, _, _ in adam:  # DistAdamW: dim 0 padded to a multiple of W
            ops["reduce_scatter"] += padded_numel(shape, W) * master_bytes
            ops["all_gather"] += padded_numel(shape, W) * master_bytes
        for shape in sorted({p[1] for p in muon}):  # DistMuon: blocks of W whole matrices per shape group
            count = sum(1 for p in muon if p[1] == shape)
            block_bytes = W * math.prod(shape) * master_bytes
            ops["reduce_scatter"] += math.ceil(count / W) * block_bytes
            ops["all_gather"] += math.ceil(count / W) * block_bytes
    else:
        last_block = max(p[2] for p in params if p[2] is not None)
        for _, shape, block, _ in params:
            n = padded_numel(shape, W)
            # forward gathers everything; backward re-gathers every block except the last (kept gathered, see
            # apply_fsdp); the root (wte, lm_head) is not resharded between forward and backward
            regather = block is not None and block != last_block
            ops["all_gather"] += grad_accum * n * param_bytes * (2 if regather else 1)
            ops["reduce_scatter"] += grad_accum * n * reduce_bytes
        for shape in sorted({p[1] for p in muon}):  # FSDPMuon: (W, K, ceil(rows/W), cols) buffer, sent twice
            count = sum(1 for p in muon if p[1] == shape)
            K = math.ceil(count / W)
            ops["all_to_all"] += 2 * W * K * math.ceil(shape[0] / W) * shape[1] * ns_bytes
    sent = (W - 1) / W * (ops["all_gather"] + ops["reduce_scatter"] + ops["all_to_all"])
    return ops, sent


def _tp_comm_model(params, W, grad_accum, param_bytes, reduce_bytes, ns_bytes, tokens, d_model, act_bytes, ac):
    """mode tp2 of comm_model: TP all-reduces over tp ranks, FSDP over dp = W/tp ranks, ShardedMuon over W."""
    if W % TP:
        raise ValueError(f"mode tp2 needs a world size divisible by {TP}, got {W}")
    dp = W // TP
    n_layer = 1 + max(p[2] for p in params if p[2] is not None)
    ops = {"all_gather": 0, "reduce_scatter": 0, "all_to_all": 0, "all_reduce": 0}
    # 2 all-reduces per block in forward (attention and MLP outputs), 2 in backward (their input gradients), 2 more
    # when the block's forward is re-run by activation checkpointing
    ops["all_reduce"] = grad_accum * (6 if ac else 4) * n_layer * tokens * d_model * act_bytes
    last_block = n_layer - 1
    for name, shape, block, _ in params if dp > 1 else []:  # FSDP on one data rank communicates nothing
        n = padded_numel(tp_local_shape(name, shape, TP), dp)  # FSDP shards each rank's TP shard over dp
        regather = block is not None and block != last_block
        ops["all_gather"] += grad_accum * n * param_bytes * (2 if regather else 1)
        ops["reduce_scatter"] += grad_accum * n * reduce_bytes
    muon = [p for p in params if p[3]]
    for shape in sorted({p[1] for p in muon}):
        # ShardedMuon: (W, K, slot) buffers, slot = the largest rank's rectangle of a matrix in the group
        group = [p for p in muon if p[1] == shape]
        K = math.ceil(len(group) / W)
        slot = max(math.ceil(tp_local_shape(p[0], shape, TP)[0] / dp) * tp_local_shape(p[0], shape, TP)[1] for p in group)
        ops["all_to_all"] += 2 * W * K * slot * ns_bytes
    sent = ((dp - 1) / dp * (ops["all_gather"] + ops["reduce_scatter"]) + (W - 1) / W * ops["all_to_all"]
            + 2 * (TP - 1) / TP * ops["all_reduce"])
    return ops, sent


def memory_model(params, W, mode):
    """Per-rank resident bytes of params + grads + optimizer state (activations and transient buffers excluded)."""
    P = sum(math.prod(p[1]) for p in params)
    P_muon = sum(math.prod(p[1]) for p in params if p[3]) if mode != "fsdp_adamw" else 0
    P_adam = P - P_muon
    state = 8 * P_adam + 4 * P_muon  # AdamW: exp_avg + exp_avg_sq (fp32); Muon: momentum (fp32)
    if mode == "ddp":
        return 4 * P + 4 * P + state / W  # full fp32 params and grads, sharded state
    if mode == "tp2":
        # block matrices sharded over all W ranks (tp x dp); wte and lm_head only over the W/TP data ranks
        per_elem = {True: 4 + 4 + 4, False: 4 + 4 + 8}  # param + grad + (Muon momentum | AdamW moments)
        return sum(math.prod(p[1]) * per_elem[p[3]] / (W if p[2] is not None else W // TP) for p in params)
    return (4 * P + 4 * P + state) / W  # everything sharded (plus one gathered block at a time, not counted)


def analytic_section(depths, W, vocab_size, seq_len, total_batch, device_batch):
    lines = [
        f"### Analytic: per rank, per optimizer step, {W} ranks (vocab {vocab_size}, T={seq_len}, total batch {total_batch:,} tokens)",
        "",
        "FSDP: bf16 all-gathers, fp32 reduce-scatters (the default `--fsdp_reduce_dtype=float32`), FSDPMuon all-to-alls in bf16.",
        "DDP: fp32 gradients and parameters. Memory = params + grads + optimizer state per rank (no activations).",
        f"tp2: TP={TP} x FSDP over {W // TP} data ranks; the all-reduces carry bf16 activations (B*T*d per block, 4 per block per micro-step).",
        "",
        "| depth | params | device batch | grad accum | path | all-gather | reduce-scatter | all-to-all | all-reduce (TP) | sent per rank | memory per rank |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for depth in depths:
        params = param_table(config_for_depth(depth, vocab_size, seq_len))
        P = sum(math.prod(p[1]) for p in params)
        dbs = device_batch.get(depth, 1)
        d_model = config_for_depth(depth, vocab_size, seq_len).n_embd
        for mode in MODES:
            data_ranks = W // TP if mode == "tp2" else W  # a tp group of TP ranks shares one micro-batch
            accum = max(1, total_batch // (dbs * seq_len * data_ranks))
            ops, sent = comm_model(params, W, mode, grad_accum=accum, tokens=dbs * seq_len, d_model=d_model)
            lines.append(
                f"| d{depth} | {P / 1e9:.2f}B | {dbs} | {accum} | {mode} | {ops['all_gather'] / GiB:.2f} GiB | "
                f"{ops['reduce_scatter'] / GiB:.2f} GiB | {ops['all_to_all'] / GiB:.3f} GiB | {ops['all_reduce'] / GiB:.2f} GiB | {sent / GiB:.2f} GiB | "
                f"{memory_model(params, W, mode) / GiB:.1f} GiB |"
            )
    lines.append("")
    lines.append("Per fwd/bwd micro-step (grad accum 1) the FSDP rows divide by the accumulation factor; the DDP path's "
                 "traffic does not depend on it. FSDPMuon adds 2·(W-1)/W·2 bytes per matrix element over FSDP+AdamW:")
    for depth in depths:
        params = param_table(config_for_depth(depth, vocab_size, seq_len))
        _, a = comm_model(params, W, "fsdp_adamw", grad_accum=1)
        _, m = comm_model(params, W, "fsdp_muon", grad_accum=1)
        lines.append(f"- d{depth}: FSDP+Muon sends {m / GiB:.2f} GiB vs FSDP+AdamW {a / GiB:.2f} GiB per micro-step (+{100 * (m - a) / a:.1f}%)")
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# the measured run (worker side, under torchrun)

BENCH_CONFIG = dict(sequence_len=128, vocab_size=4096, n_layer=4, n_head=2, n_kv_head=2, n_embd=256)
BENCH_BATCH = 4  # sequences per rank


class CommCounter:
    """Wraps torch.distributed's tensor collectives and records (op, bytes) per call while `active`."""

    NAMES = {
        "all_gather_into_tensor": ("all_gather", 0),  # index of the tensor whose size counts (output)
        "all_gather_single": ("all_gather", 0),
        "reduce_scatter_tensor": ("reduce_scatter", 1),  # the input
        "reduce_scatter_single": ("reduce_scatter", 1),
        "all_to_all_single": ("all_to_all", 1),
        "all_reduce": ("all_reduce", 0),
        "broadcast": ("broadcast", 0),
    }
    FUNCOL_NAMES = {"all_reduce": "all_reduce", "all_gather_single": "all_gather", "all_gather_tensor": "all_gather",
                    "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
                    "all_to_all_single": "all_to_all"}

    def __init__(self):
        import torch.distributed as dist

        self.dist = dist
        self.calls = []
        self.active = False
        self.saved = {}
        for name, (op, idx) in self.NAMES.items():
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self.saved[name] = fn
            setattr(dist, name, self._wrap(fn, op, idx))
        # DTensor (tensor parallelism) communicates through the functional collectives, not the functions above
        import torch.distributed._functional_collectives as funcol

        self.funcol = funcol
        self.saved_funcol = {}
        for name, op in self.FUNCOL_NAMES.items():
            fn = getattr(funcol, name, None)
            if fn is not None:
                self.saved_funcol[name] = fn
                setattr(funcol, name, self._wrap(fn, op, 0))

    def _wrap(self, fn, op, idx):
        def wrapper(*args, **kwargs):
            if self.active:
                t = args[idx] if len(args) > idx else list(kwargs.values())[idx]
                self.calls.append((op, t.numel() * t.element_size()))
            return fn(*args, **kwargs)

        return wrapper

    def totals(self):
        out = {}
        for op, nbytes in self.calls:
            c = out.setdefault(op, {"calls": 0, "bytes": 0})
            c["calls"] += 1
            c["bytes"] += nbytes
        return out

    def restore(self):
        for name, fn in self.saved.items():
            setattr(self.dist, name, fn)
        for name, fn in self.saved_funcol.items():
            setattr(self.funcol, name, fn)


def worker(steps, warmup, modes=MODES):
    import torch.distributed as dist

    torch.set_num_threads(1)
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank, W = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    counter = CommCounter() if distributed else None
    config = GPTConfig(**BENCH_CONFIG)
    results = {}
    for mode in (modes if distributed else ("single",)):
        torch.manual_seed(0)
        with torch.device("meta"):
            model = GPT(config, attn="sdpa")
        model.to_empty(device="cpu")
        model.init_weights()
        if mode.startswith("fsdp"):
            from nanochat.distributed.fsdp import apply_fsdp
            from nanochat.optim.sharded import setup_fsdp_optimizers

            apply_fsdp(model)
            opts = setup_fsdp_optimizers(model, use_muon=mode == "fsdp_muon")
        elif mode == "tp2":
            from nanochat.distributed.tensor_parallel import apply_tp, setup_tp_optimizers

            apply_tp(model, TP)
            opts = setup_tp_optimizers(model, use_muon=True)
        else:
            opts = model.setup_optimizers(use_muon=True)
        g = torch.Generator().manual_seed(rank // TP if mode == "tp2" else rank)  # tp ranks share a batch
        fwdbwd, optim = [], []
        for step in range(warmup + steps):
            x = torch.randint(0, config.vocab_size, (BENCH_BATCH, config.sequence_len + 1), generator=g)
            if distributed:
                dist.barrier()
                counter.active = step == warmup  # record exactly one (post-warmup) step
            t0 = time.perf_counter()
            model(x[:, :-1], x[:, 1:]).backward()
            t1 = time.perf_counter()
            for opt in opts:
                opt.step()
            model.zero_grad(set_to_none=True)
            t2 = time.perf_counter()
            if distributed:
                counter.active = False
            if step >= warmup:
                fwdbwd.append(t1 - t0)
                optim.append(t2 - t1)
        res = {"fwdbwd_s": statistics.median(fwdbwd), "optim_s": statistics.median(optim), "step_s": statistics.median(a + b for a, b in zip(fwdbwd, optim))}
        if distributed:
            res["measured"] = counter.totals()
            counter.calls = []
            params = param_table(config)
            ops, sent = comm_model(params, W, mode, grad_accum=1, param_bytes=4, reduce_bytes=4, master_bytes=4, ns_bytes=4,
                                   tokens=BENCH_BATCH * config.sequence_len, d_model=config.n_embd, act_bytes=4)  # CPU: all fp32
            res["analytic"] = ops
            res["analytic_sent"] = sent
        results[mode] = res
    if rank == 0:
        print("RESULTS " + json.dumps({"world": W, "config": BENCH_CONFIG, "batch_per_rank": BENCH_BATCH, "results": results}), flush=True)
    if distributed:
        compute_cleanup()  # barrier, destroy, and the groups really go at exit (nanochat.distributed.dist.release_process_groups)


# -----------------------------------------------------------------------------
# driver


def launch(nproc, steps, warmup, modes=MODES):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    me = str(Path(__file__).resolve())
    if nproc > 1:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1", "--master_addr=127.0.0.1", f"--master_port={port}", me]
    else:
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            env.pop(k, None)
        cmd = [sys.executable, me]
    cmd += ["--worker", f"--steps={steps}", f"--warmup={warmup}", f"--modes={','.join(modes)}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark worker failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULTS "))
    return json.loads(line[len("RESULTS ") :])


def measured_section(steps, warmup):
    single = launch(1, steps, warmup)["results"]["single"]
    run = launch(2, steps, warmup)
    res = run["results"]
    # tp2 on 2 ranks has one data rank (FSDP then communicates nothing): DP=2 x TP=2 on 4 ranks as well
    res["dp2 x tp2 (4 ranks)"] = launch(4, steps, warmup, modes=("tp2",))["results"]["tp2"]
    modes = [*MODES, "dp2 x tp2 (4 ranks)"]
    c = run["config"]
    lines = [
        f"### Measured on CPU: 2 gloo ranks (and 4 for dp2 x tp2), one optimizer step (n_layer={c['n_layer']}, n_embd={c['n_embd']}, vocab={c['vocab_size']}, "
        f"T={c['sequence_len']}, {run['batch_per_rank']} sequences per rank; median of {steps} steps after {warmup} warm-up)",
        "",
        "| path | fwd+bwd | optimizer step | total step | collectives recorded in one step | bytes recorded | analytic bytes | per-rank sent (analytic) |",
        "|---|---|---|---|---|---|---|---|",
        f"| single process (AdamW + Muon, same per-rank batch) | {single['fwdbwd_s'] * 1000:.0f} ms | {single['optim_s'] * 1000:.0f} ms | {single['step_s'] * 1000:.0f} ms | - | - | - | - |",
    ]
    for mode in modes:
        r = res[mode]
        measured = r["measured"]
        calls = ", ".join(f"{op} x{v['calls']}" for op, v in sorted(measured.items()))
        mbytes = sum(v["bytes"] for v in measured.values())
        abytes = sum(r["analytic"].values())
        lines.append(
            f"| {mode} | {r['fwdbwd_s'] * 1000:.0f} ms | {r['optim_s'] * 1000:.0f} ms | {r['step_s'] * 1000:.0f} ms | {calls} | "
            f"{mbytes / 2**20:.2f} MiB | {abytes / 2**20:.2f} MiB | {r['analytic_sent'] / 2**20:.2f} MiB |"
        )
    mismatches = [m for m in modes if {k: v for k, v in res[m]["analytic"].items() if v} != {op: v["bytes"] for op, v in res[m]["measured"].items()}]
    lines.append("")
    lines.append("Recorded bytes per collective type equal the analytic model for every path." if not mismatches else
                 f"WARNING: recorded bytes differ from the analytic model for {mismatches}: {json.dumps({m: res[m] for m in mismatches})}")
    return "\n".join(lines), mismatches


FLAGS = Flags(
    Flag("world", 8, "ranks for the analytic tables"),
    Flag("depths", "20,40", "comma-separated model depths for the analytic tables"),
    Flag("vocab_size", 65536, "vocabulary size of the analytic models"),
    Flag("seq_len", 2048, "sequence length of the analytic models"),
    Flag("total_batch", 524288, "tokens per optimizer step"),
    Flag("steps", 5, "timed steps of the measured run"),
    Flag("warmup", 2, "untimed steps before them"),
    Flag("no_run", False, "analytic tables only (no processes launched)"),
    Flag("worker", False, "internal: run as one rank of the measured run", hidden=True),
    Flag("modes", ",".join(MODES), "internal: the paths the worker measures", hidden=True),
    description=__doc__,
)


def main(argv=None):
    args = FLAGS.parse_args(argv)
    if args.worker:
        return worker(args.steps, args.warmup, tuple(args.modes.split(",")))
    depths = [int(d) for d in args.depths.split(",")]
    # the presets' device batch per depth (nanochat/presets.py: the one table pretrain.sh uses)
    device_batch = {d: p.device_batch_size for d, p in PRESETS.items()}
    print(analytic_section(depths, args.world, args.vocab_size, args.seq_len, args.total_batch, device_batch))
    if not args.no_run:
        print()
        text, mismatches = measured_section(args.steps, args.warmup)
        print(text)
        if mismatches:
            sys.exit(1)


if __name__ == "__main__":
    main()
