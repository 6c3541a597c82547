"""
Train a tiny GPT for a few steps in one of three modes and save what the tests compare:

    python gpt_train_check.py --mode=single --use_muon=1,0 --out=ref.pt          # one process, whole batch
    torchrun --nproc_per_node=2 gpt_train_check.py --mode=ddp  --use_muon=1 --out=ddp.pt   # DistAdamW + DistMuon
    torchrun --nproc_per_node=2 gpt_train_check.py --mode=fsdp --use_muon=1,0 --out=fsdp.pt  # FSDPAdamW (+FSDPMuon)

--record=1 also runs the record recipe's optimizer options (nanochat/muon.py RECORD_MUON with cautious weight decay
on a schedule; AdamW groups with their own betas) on the same model, saved under the key "record".

Every mode sees the same global batch per step (the distributed ranks each take their rows of it) and the same
initial weights. Rank 0 saves, per use_muon value, {"losses", "params" (full state dict at the end), "init",
"probe_logits", "samples", "checks"} under the key "use_muon=<v>".
Distributed modes also check, in-process, that a mid-run checkpoint (full model state dict + per-rank optimizer
states, through torch.save/torch.load) resumed in a fresh model/optimizers continues exactly like the uninterrupted run.
With --ddp_ckpt, the fsdp mode also loads that single-file state dict into a fresh sharded model and saves its logits.
"""

import argparse
import io
import json

import torch
import torch.distributed as dist

from nanochat.distributed.dist import compute_cleanup
from nanochat.gpt import GPT, GPTConfig
from nanochat.muon import RECORD_MUON

STEPS = 6
RESUME_AT = 3  # checkpoint after this many steps
GLOBAL_BATCH = 4
CONFIG = GPTConfig(sequence_len=16, vocab_size=200, n_layer=3, n_head=2, n_kv_head=1, n_embd=64)
PROBE = torch.arange(24).view(2, 12) % CONFIG.vocab_size  # fixed inputs for logits comparisons


def global_batch(step):
    # arithmetic sequences with a random start and stride: learnable, so the losses fall and the optimizers do real work
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=g)
    data = (start + stride * torch.arange(CONFIG.sequence_len + 1)) % CONFIG.vocab_size
    return data[:, :-1], data[:, 1:]


def rank_rows(t, rank, world):
    n = t.size(0) // world
    return t[rank * n : (rank + 1) * n]


def fresh_model():
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(CONFIG, attn="sdpa")
    model.to_empty(device="cpu")
    model.init_weights("nanochat")
    return model


def lrs(use_muon):
    # nanochat's defaults, except a smaller matrix LR when AdamW takes the matrices (it gets the width scaling x3.5
    # at n_embd=64 and would make this 6-step trajectory noisy); weight decay on to exercise it
    return dict(unembedding_lr=0.004, embedding_lr=0.2, matrix_lr=0.02 if use_muon else 0.003, weight_decay=0.01, use_muon=use_muon)


RECORD_BETAS = [(0.8, 0.96), (0.8, 0.995)]  # lm_head's and wte's in 92d63d4


def record_options(opts):
    """The record recipe's optimizer options on GPT's groups: RECORD_MUON and cautious weight decay on the Muon groups,
    92d63d4's own betas on each AdamW group (the same edit on every path, so N ranks must still equal one process)."""
    for opt in opts:
        for i, group in enumerate(opt.param_groups):
            if "momentum" in group:
                group.update(RECORD_MUON, weight_decay=0.2)
            else:
                group["betas"] = RECORD_BETAS[i]
    return opts


def build(mode, use_muon, state_dict=None, record=False):
    """(model, optimizers); state_dict: a full single-file state dict to start from (else the seeded init). record:
    the options are set in GPT.setup_optimizers' groups, where the record GPT sets them, so the FSDP path's rebuild of
    those groups for DTensor parameters (optim/sharded.py) has to carry them over."""
    model = fresh_model()
    setup = GPT.setup_optimizers
    if record:
        GPT.setup_optimizers = lambda self, **kwargs: record_options(setup(self, **kwargs))
    try:
        if mode == "fsdp":
            from nanochat.distributed.fsdp import apply_fsdp, load_full_model_state_dict
            from nanochat.optim.sharded import setup_fsdp_optimizers

            apply_fsdp(model)
            if state_dict is not None:
                load_full_model_state_dict(model, state_dict)
            opts = setup_fsdp_optimizers(model, **lrs(use_muon))
        else:
            if state_dict is not None:
                model.load_state_dict(state_dict)
            opts = model.setup_optimizers(**lrs(use_muon))
    finally:
        GPT.setup_optimizers = setup
    return model, opts


def full_state(model, mode):
    if mode == "fsdp":
        from nanochat.distributed.fsdp import full_model_state_dict

        sd = full_model_state_dict(model)
        # every rank needs the full dict to load it: here, in memory, rank 0's copy is broadcast
        obj = [sd]
        dist.broadcast_object_list(obj, src=0)
        return obj[0]
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_steps(model, opts, steps, rank, world):
    losses = []
    for step in steps:
        for opt in opts:  # a schedule, as the training loop applies it: the optimizers must read it every step
            for group in opt.param_groups:
                group["lr"] = group["initial_lr"] * (1.0 - 0.05 * step)
                if "momentum" in group:
                    group["momentum"] = 0.85 + 0.01 * step
                if group.get("cautious_wd"):
                    group["weight_decay"] = 0.2 * (1 - step / STEPS)
        x, y = global_batch(step)
        loss = model(rank_rows(x, rank, world), rank_rows(y, rank, world))
        loss.backward()
        for opt in opts:
            opt.step()
        model.zero_grad(set_to_none=True)
        loss = loss.detach()
        if world > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # equal shards: the mean of rank means is the global mean
        losses.append(loss.item())
    return losses


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def run(mode, use_muon, rank, world, ddp_ckpt=None, record=False):
    """Train STEPS steps; returns the results dict described in the module docstring (meaningful on rank 0)."""
    distributed = mode != "single"
    checks = {}
    model, opts = build(mode, use_muon, record=record)
    init = full_state(model, mode)
    losses = train_steps(model, opts, range(RESUME_AT), rank, world)

    # mid-run: evaluation logits and sampling (under FSDP every rank runs them: each forward is a collective)
    with torch.no_grad():
        probe_logits = model(PROBE)
    samples = list(model.generate([1, 2, 3], max_tokens=5, temperature=0.0))
    samples += list(model.generate([4, 5], max_tokens=5, temperature=1.0, top_k=20, seed=7))

    if distributed:
        ckpt_model = full_state(model, mode)
        ckpt_optim = roundtrip([opt.state_dict() for opt in opts])
    losses += train_steps(model, opts, range(RESUME_AT, STEPS), rank, world)
    final = full_state(model, mode)

    if distributed:
        # resume in a fresh model and fresh optimizers from the mid-run checkpoint
        model2, opts2 = build(mode, use_muon, state_dict=ckpt_model, record=record)
        for opt, sd in zip(opts2, ckpt_optim):
            opt.load_state_dict(sd)
        resumed_losses = train_steps(model2, opts2, range(RESUME_AT, STEPS), rank, world)
        resumed = full_state(model2, mode)
        checks["resume_losses_equal"] = resumed_losses == losses[RESUME_AT:]
        checks["resume_params_equal"] = all(torch.equal(resumed[k], final[k]) for k in final)
        checks["optimizer_classes"] = [type(o).__name__ for o in opts]
        # what the distributed optimizers were built with (the record options must reach them through every path)
        checks["muon_ns"] = sorted({g["ns"] for o in opts for g in o.param_groups if "momentum" in g})
        checks["adamw_betas"] = [tuple(g["betas"]) for o in opts for g in o.param_groups if "betas" in g][:2]

    with torch.no_grad():
        final_logits = model(PROBE)  # the live (sharded, under FSDP) model after training
    out = dict(losses=losses, params=final, init=init, probe_logits=probe_logits, final_logits=final_logits, samples=samples, checks=checks)
    if mode == "fsdp" and ddp_ckpt:
        from nanochat.distributed.fsdp import load_full_model_state_dict

        # a single-file checkpoint written by the DDP / single-process path, loaded into a fresh sharded model
        model3, _ = build("fsdp", use_muon)
        load_full_model_state_dict(model3, torch.load(ddp_ckpt, map_location="cpu", weights_only=True))
        checks["block_weights_are_dtensors"] = type(model3.transformer.h[0].mlp.c_fc.weight).__name__ == "DTensor"
        with torch.no_grad():
            out["ddp_ckpt_logits"] = model3(PROBE)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["single", "ddp", "fsdp"], required=True)
    ap.add_argument("--use_muon", default="1", help="comma-separated values to run, e.g. 1,0")
    ap.add_argument("--record", type=int, default=0, help="also train with the record recipe's optimizer options (key 'record')")
    ap.add_argument("--synthetic", type=int, default=0, help="also run the shape checks: fsdp_synthetic.py (fsdp) or dist_optim_check.py (ddp)")
    ap.add_argument("--ddp_ckpt", default=None, help="fsdp mode: a single-file model state dict to load into a fresh sharded model")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    distributed = args.mode != "single"
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)

    results = {}
    for flag in args.use_muon.split(","):
        results[f"use_muon={int(flag)}"] = run(args.mode, bool(int(flag)), rank, world, args.ddp_ckpt)
    if args.record:
        results["record"] = run(args.mode, True, rank, world, record=True)
    if args.synthetic and args.mode == "fsdp":
        import fsdp_synthetic  # next to this script

        results["synthetic"] = fsdp_synthetic.run(rank, world)
        results["synthetic_record"] = fsdp_synthetic.run(rank, world, record=True)
    elif args.synthetic and args.mode == "ddp":
        import dist_optim_check  # next to this script

        results["synthetic"] = {r["check"]: r for r in dist_optim_check.run_checks(rank, world)}

    if rank == 0:
        torch.save(results, args.out)
        summary = {k: (v["checks"] if "checks" in v else v) for k, v in results.items()}
        print(json.dumps({"mode": args.mode, "summary": summary}, default=str), flush=True)
    if distributed:
        compute_cleanup()  # barrier, destroy, and the groups really go at exit (nanochat.distributed.dist.release_process_groups)


if __name__ == "__main__":
    main()
