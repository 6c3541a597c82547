"""
Run under torchrun (gloo, CPU), standalone or through gpt_train_check.py --mode=ddp --synthetic=1: DistAdamW and DistMuon against torch.optim.AdamW and Muon in one process.

Each rank trains the distributed optimizer on its half of a global batch; next to it, every rank also runs the
single-process reference (plain optimizer, whole batch, no collectives). After every step the parameters must agree.
Also: a state_dict round trip per rank mid-run (save, fresh optimizer, load, continue == uninterrupted), and the
error raised when a rank loads another rank's file. Standalone it prints one JSON line per check:
{"check": name, "ok": bool, ...}.
"""

import io
import json
import sys

import torch
import torch.distributed as dist

from nanochat.adamw import DistAdamW
from nanochat.distributed.dist import compute_cleanup
from nanochat.muon import RECORD_MUON, DistMuon, Muon

STEPS = 6
BATCH = 8  # global batch; each rank takes BATCH // world rows


def make_params(shapes, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g) * 0.5) for s in shapes]


def batch(step, dims, seed=1234):
    """The global batch of this step: one (BATCH, d) input per distinct input width."""
    g = torch.Generator().manual_seed(seed + step)
    return {d: torch.randn(BATCH, d, generator=g) for d in sorted(set(dims))}


def loss_fn(params, xs):
    """A real, nonlinear loss of the parameters on a batch (mean over the batch rows)."""
    loss = 0.0
    for p in params:
        if p.ndim == 2:
            loss = loss + torch.tanh(xs[p.size(1)] @ p.T).pow(2).mean() + 0.1 * (xs[p.size(1)] @ p.T).mean()
        else:
            loss = loss + torch.sin(xs[p.size(0)] * p).sum(-1).mean()
    return loss


def in_dims(shapes):
    return [s[1] if len(s) == 2 else s[0] for s in shapes]


def step_with_grads(params, xs, opt):
    for p in params:
        p.grad = None
    loss = loss_fn(params, xs)
    loss.backward()
    opt.step()
    return loss.detach()


def local_rows(x, rank, world):
    n = x.size(0) // world
    return x[rank * n : (rank + 1) * n]


def max_diff(a, b):
    return max((x.detach() - y.detach()).abs().max().item() for x, y in zip(a, b))


def roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def compare_run(name, shapes, make_dist, make_ref, schedule=None, tol=1e-5):
    """Train dist (half batch per rank) and ref (whole batch) side by side; also a mid-run state_dict round trip."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dims = in_dims(shapes)
    p_dist, p_ref = make_params(shapes, 0), make_params(shapes, 0)
    opt_d, opt_r = make_dist(p_dist), make_ref(p_ref)
    worst, saved = 0.0, None
    for step in range(STEPS):
        if schedule:
            schedule(opt_d, step)
            schedule(opt_r, step)
        xs = batch(step, dims)
        step_with_grads(p_dist, {d: local_rows(x, rank, world) for d, x in xs.items()}, opt_d)
        step_with_grads(p_ref, xs, opt_r)
        worst = max(worst, max_diff(p_dist, p_ref))
        if step == STEPS // 2 - 1:
            saved = ([p.detach().clone() for p in p_dist], roundtrip(opt_d.state_dict()))
    # resume: fresh params (copied from the mid-run snapshot) and a fresh optimizer loaded from this rank's state
    p_res = [torch.nn.Parameter(t.clone()) for t in saved[0]]
    opt_res = make_dist(p_res)
    opt_res.load_state_dict(saved[1])
    for step in range(STEPS // 2, STEPS):
        if schedule:
            schedule(opt_res, step)
        xs = batch(step, dims)
        step_with_grads(p_res, {d: local_rows(x, rank, world) for d, x in xs.items()}, opt_res)
    resume_exact = all(torch.equal(a, b) for a, b in zip(p_res, p_dist))
    # parameters must also stay identical across ranks (every rank holds the full model on the DDP path)
    flat = torch.cat([p.detach().flatten() for p in p_dist])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    ranks_equal = all(torch.equal(gathered[0], g) for g in gathered)
    moved = max_diff(p_dist, make_params(shapes, 0))
    ok = worst < tol and resume_exact and ranks_equal and moved > 1e-3
    return result(name, ok, max_param_diff=worst, resume_exact=resume_exact, ranks_equal=ranks_equal, moved=moved)


def result(name, ok, **info):
    return {"check": name, "ok": bool(ok), **info}


def run_checks(rank, world):
    """All checks (collective: every rank calls it); returns a list of result dicts."""
    assert world == 2, "these checks are written for 2 ranks"
    results = []

    # --- AdamW: uneven dim 0 (5 rows on 2 ranks; 1 row: rank 1 owns nothing), 1-D params, lr_mul/wd_mul
    adam_shapes = [(5, 3), (4, 6), (1, 4), (7,), (3, 5)]

    def tag(params):
        params[1].lr_mul, params[1].wd_mul = 0.5, 2.0
        return params

    def dist_adam(ps):
        tag(ps)
        return DistAdamW([dict(params=ps[:3], lr=0.01), dict(params=ps[3:], lr=0.02, weight_decay=0.0)], lr=0.01, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.1)

    def ref_adam(ps):
        # torch AdamW has no lr_mul/wd_mul: give the tagged parameter its own group with the multiplied values
        return torch.optim.AdamW(
            [dict(params=[ps[0], ps[2]], lr=0.01), dict(params=[ps[1]], lr=0.005, weight_decay=0.2), dict(params=ps[3:], lr=0.02, weight_decay=0.0)],
            lr=0.01, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.1, foreach=False, fused=False,
        )

    results.append(compare_run("distadamw_vs_adamw", adam_shapes, dist_adam, ref_adam))

    # --- Muon: 3 matrices of one shape (not a multiple of 2), a single tall one, wide ones; momentum changed mid-run
    muon_shapes = [(6, 4), (4, 8), (6, 4), (9, 5), (6, 4), (4, 8)]

    def sched(opt, step):
        for g in opt.param_groups:
            g["momentum"] = 0.85 + 0.02 * step
            g["lr"] = 0.02 * (1 - step / (2 * STEPS))

    results.append(compare_run("distmuon_vs_muon", muon_shapes, lambda ps: DistMuon(ps, lr=0.02), lambda ps: Muon(ps, lr=0.02), schedule=sched))
    results.append(compare_run("distmuon_vs_muon_plain_momentum", muon_shapes[:3], lambda ps: DistMuon(ps, lr=0.03, nesterov=False), lambda ps: Muon(ps, lr=0.03, nesterov=False)))

    # --- the record options (Polar Express, MuonEq, Muon+, NorMuon, cautious weight decay) with a weight-decay
    #     schedule, tall and wide matrices (NorMuon's buffer per row and per column); AdamW groups with their own betas
    def record_sched(opt, step):
        sched(opt, step)
        for g in opt.param_groups:
            g["weight_decay"] = 0.2 * (1 - step / STEPS)

    results.append(compare_run("distmuon_record_vs_muon", muon_shapes, lambda ps: DistMuon(ps, lr=0.02, **RECORD_MUON),
                               lambda ps: Muon(ps, lr=0.02, **RECORD_MUON), schedule=record_sched))

    def adam_groups(ps):
        return [dict(params=ps[:2], lr=0.01, betas=(0.8, 0.96), weight_decay=0.01), dict(params=[ps[2]], lr=0.02, betas=(0.8, 0.995), eps=1e-8),
                dict(params=ps[3:], lr=0.03, betas=(0.96, 0.95), weight_decay=0.05)]

    results.append(compare_run("distadamw_group_betas_vs_adamw", adam_shapes, lambda ps: DistAdamW(adam_groups(ps), eps=1e-10, weight_decay=0.0),
                               lambda ps: torch.optim.AdamW(adam_groups(ps), eps=1e-10, weight_decay=0.0, foreach=False, fused=False)))

    # --- another rank's state must be refused with a clear message
    ps = make_params([(4, 4), (4, 4)], 0)
    opt = DistMuon(ps)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    sd = opt.state_dict()
    sd["dist"]["rank"] = 1 - rank
    try:
        opt.load_state_dict(sd)
        results.append(result("wrong_rank_refused", False))
    except ValueError as e:
        results.append(result("wrong_rank_refused", "same number of ranks" in str(e), message=str(e)))
    return results


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for r in run_checks(dist.get_rank(), dist.get_world_size()):
        if dist.get_rank() == 0:
            print(json.dumps(r), flush=True)
    compute_cleanup()  # barrier, destroy, and the groups really go at exit (nanochat.distributed.dist.release_process_groups)


if __name__ == "__main__":
    sys.exit(main())
