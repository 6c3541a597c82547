"""
The record recipe's optimizer (nanochat/muon.py's record options, AdamW param groups with their own betas, lr and
weight decay) in one process:

- against nanochat 92d63d4's own MuonAdamW (its nanochat/optim.py, imported from the anchor tarball in
  ../shared/bench by tests/anchors.py, run eagerly in fp32 on CPU): the same parameters bit for bit after several
  steps on random gradients, for the
  shapes the record model has (square, tall and wide block matrices, a tiny gate, embeddings, lm_head, scalars), with
  the training loop's lr / momentum / weight-decay schedules changing every step
- each record option against its formula written out by hand (Polar Express, MuonEq, Muon+, NorMuon, cautious decay)
- options off == the December update bit for bit; state dict round trip of the NorMuon buffers
The distributed forms against this one-process optimizer: tests/distributed/test_dist_optim.py, test_fsdp.py, test_tp.py.
"""

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from anchors import load_92d63d4_module
from nanochat.adamw import AdamW
from nanochat.muon import RECORD_MUON, Muon, zeropower_via_polar_express


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# A record-recipe model's parameters at small sizes (n_embd 128, 2 layers, vocab 512, kv dim 128), by optimizer
# group as 92d63d4's GPT.setup_optimizer makes them. Muon: square attention matrices, the tall MLP input (512 x 128),
# the wide MLP output (128 x 512), the value-embedding gate (2 x 12, wide and tiny). AdamW: lm_head, wte, value
# embeddings, resid/x0 scalars, smear (gate 1 x 24 and two scalars).
D, V, L = 128, 512, 2
MATRICES = [(D, D)] * 8 + [(4 * D, D)] * 2 + [(D, 4 * D)] * 2 + [(2, 12)]
ADAMW_GROUPS = [  # (shapes, lr, betas, weight decay) as 92d63d4 sets them (dmodel scale of n_embd=128)
    ([(V, D)], 0.008 * (D / 768) ** -0.5, (0.8, 0.96), 0.01),  # lm_head
    ([(V, D)], 0.3 * (D / 768) ** -0.5, (0.8, 0.995), 0.001),  # wte
    ([(V, D)], 0.3 * (D / 768) ** -0.5 * 0.5, (0.8, 0.995), 0.01),  # value embeddings
    ([(L,)], 0.5 * 0.01, (0.8, 0.95), 0.05),  # resid_lambdas
    ([(L,)], 0.5, (0.96, 0.95), 0.0),  # x0_lambdas
    ([(1, 24), (1,), (1,)], 0.2, (0.8, 0.95), 0.0),  # smear gate, smear and backout lambdas
]
MATRIX_LR, WEIGHT_DECAY, STEPS = 0.02, 0.28, 6


def record_params(seed=0):
    shapes = MATRICES + [s for shapes, *_ in ADAMW_GROUPS for s in shapes]
    return [torch.nn.Parameter(randn(*s, seed=seed + i) * 0.1) for i, s in enumerate(shapes)]


def split(params):
    """(muon params, [adamw group params]) in the order of MATRICES and ADAMW_GROUPS."""
    muon, rest = params[: len(MATRICES)], params[len(MATRICES) :]
    groups = []
    for shapes, *_ in ADAMW_GROUPS:
        groups.append(rest[: len(shapes)])
        rest = rest[len(shapes) :]
    return muon, groups


def anchor_optimizer(module, params):
    muon, adam = split(params)
    groups = [dict(kind="adamw", params=ps, lr=lr, betas=betas, eps=1e-10, weight_decay=wd)
              for ps, (_, lr, betas, wd) in zip(adam, ADAMW_GROUPS)]
    for shape in sorted({p.shape for p in muon}):
        groups.append(dict(kind="muon", params=[p for p in muon if p.shape == shape], lr=MATRIX_LR, momentum=0.95,
                           ns_steps=5, beta2=0.9, weight_decay=WEIGHT_DECAY))
    opt = module.MuonAdamW(groups)
    for g in opt.param_groups:
        g["initial_lr"] = g["lr"]
    return [opt]


def our_optimizers(params, math="record"):
    """The interface the record GPT's setup uses: AdamW groups with their own lr/betas/eps/weight_decay in 92d63d4's
    arithmetic (math="record", nanochat/adamw.py; math="torch": torch's AdamW instead) and Muon groups with the record
    options."""
    muon, adam = split(params)
    groups = [dict(params=ps, lr=lr, betas=betas, eps=1e-10, weight_decay=wd)
              for ps, (_, lr, betas, wd) in zip(adam, ADAMW_GROUPS)]
    adamw = AdamW([dict(g, math="record") for g in groups]) if math == "record" else \
        torch.optim.AdamW(groups, foreach=False, fused=False)
    opts = [adamw, Muon([dict(params=muon, lr=MATRIX_LR, momentum=0.95, weight_decay=WEIGHT_DECAY, **RECORD_MUON)])]
    for opt in opts:
        for g in opt.param_groups:
            g["initial_lr"] = g["lr"]
    return opts


def schedule(opts, step):
    """92d63d4's base_train schedules, compressed into STEPS steps: lr warmdown, Muon momentum, cosine weight decay."""
    lrm = 1.0 - 0.1 * step
    for opt in opts:
        for g in opt.param_groups:
            g["lr"] = g["initial_lr"] * lrm
            if "momentum" in g:
                g["momentum"] = 0.85 + 0.02 * step
                g["weight_decay"] = WEIGHT_DECAY * 0.5 * (1 + math.cos(math.pi * step / STEPS))


def train(params, opts, steps):
    for step in steps:
        schedule(opts, step)
        for i, p in enumerate(params):
            # gradients of every scale the model has (embedding rows untouched by a batch get exactly zero)
            g = randn(*p.shape, seed=1000 * step + i) * (0.01 if p.ndim == 2 else 1.0)
            if p.shape[0] == V:
                g[randn(V, seed=step).abs() > 1.0] = 0.0
            p.grad = g
        for opt in opts:
            opt.step()


@pytest.mark.slow  # a fresh process that unpacks and imports 92d63d4's code
def test_record_optimizer_matches_nanochat_92d63d4(tmp_path):
    """Every parameter equals 92d63d4's bit for bit: Muon's matrices (its scalar arithmetic in float32 included: see
    muon.f32) and the AdamW ones (math="record": its fused AdamW's float32 arithmetic). torch's AdamW, the same formula
    in another rounding (double scalars, sqrt(v) / sqrt(bc2)), is off in the last bits, which a training run amplifies
    past 1e-4 in the loss within a few dozen steps (bench/record_side_by_side.py).
    In a fresh process: in a test worker that had run other files first, the Muon matrices came out 3e-8 apart
    (some process-wide torch state that a test left behind), while alone they are equal."""
    import subprocess
    import sys

    from conftest import REPO, subprocess_env

    tests = REPO / "tests"
    code = (f"import sys; sys.path[:0] = [{str(tests)!r}, {str(tests / 'unit')!r}]\n"
            f"import pathlib, pytest, test_record_optim as t\n"
            f"with pytest.MonkeyPatch.context() as m: t.compare_with_92d63d4(pathlib.Path({str(tmp_path)!r}), m)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                       timeout=300)
    if p.returncode == 5:
        pytest.skip(p.stdout.strip().splitlines()[-1])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]


def compare_with_92d63d4(tmp_path, monkeypatch):
    try:
        module = load_92d63d4_module("nanochat/optim.py", tmp_path, monkeypatch)
    except pytest.skip.Exception as e:  # no anchor tarball: the parent test skips with this reason
        print(e.msg)
        sys.exit(5)
    ref, ours, torch_adamw = record_params(), record_params(), record_params()
    start = [p.detach().clone() for p in ref]
    train(ref, anchor_optimizer(module, ref), range(STEPS))
    train(ours, our_optimizers(ours), range(STEPS))
    train(torch_adamw, our_optimizers(torch_adamw, math="torch"), range(STEPS))
    for i, (a, b, s) in enumerate(zip(ref, ours, start)):
        moved = (a - s).abs().max().item()
        assert moved > 1e-3, f"param {i} {tuple(a.shape)} did not move ({moved})"
        assert torch.equal(a, b), f"param {i} {tuple(a.shape)}: differs from 92d63d4 by {(a - b).abs().max()} (moved {moved})"
    off = [i for i in range(len(MATRICES), len(ref)) if not torch.equal(ref[i], torch_adamw[i])]
    assert off and all((ref[i] - torch_adamw[i]).abs().max() <= 1e-6 * max(1.0, (ref[i] - start[i]).abs().max())
                       for i in off)  # torch's rounding: close, not equal


def test_record_adamw_math_is_per_group():
    """A group without "math" keeps torch's AdamW order bit for bit (adamw_update_, DistAdamW's); an unknown one is
    refused when the optimizer is built."""
    a, b = torch.nn.Parameter(randn(8, 4)), torch.nn.Parameter(randn(8, 4))
    mine, theirs = AdamW([dict(params=[a], lr=0.01, weight_decay=0.1)]), torch.optim.AdamW([b], lr=0.01, weight_decay=0.1,
                                                                                             foreach=False)
    for step in range(3):
        a.grad, b.grad = randn(8, 4, seed=step), randn(8, 4, seed=step)
        mine.step(), theirs.step()
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="math must be one of torch, record, got 'fused'"):
        AdamW([dict(params=[a], math="fused")])


# ----------------------------------------------------------------------------- each option on its own


@pytest.mark.parametrize("shape", [(32, 64), (64, 32), (48, 48), (8, 200), (256, 64)])
def test_polar_express_lands_closer_to_one(shape):
    G = randn(*shape)
    X = zeropower_via_polar_express(G)
    assert X.shape == G.shape and X.dtype == torch.float32
    s = torch.linalg.svdvals(X)
    assert s.min() > 0.85 and s.max() < 1.15, s  # the fixed quintic: [0.68, 1.32]
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    assert (X * (U @ Vh)).sum() / (X.norm() * (U @ Vh).norm()) > 0.99
    torch.testing.assert_close(zeropower_via_polar_express(G.T.contiguous()), X.T, atol=2e-6, rtol=0)
    with pytest.raises(ValueError, match="1 to 5 steps"):
        zeropower_via_polar_express(G, steps=6)


def test_polar_express_batched_equals_one_by_one():
    G = randn(3, 16, 24, seed=2)
    batched = zeropower_via_polar_express(G)
    for i in range(3):
        assert torch.equal(batched[i], zeropower_via_polar_express(G[i]))


def one_step(shape, seed=0, momentum=0.0, lr=0.1, **options):
    """(p before, p after, grad) for one Muon step with plain momentum 0: the update is the orthogonalised gradient."""
    p = torch.nn.Parameter(randn(*shape, seed=seed))
    before = p.detach().clone()
    p.grad = randn(*shape, seed=seed + 1)
    opt = Muon([p], lr=lr, momentum=momentum, nesterov=False, **options)
    opt.step()
    return before, p.detach().clone(), p.grad, opt


@pytest.mark.parametrize("shape", [(24, 16), (16, 40)])
def test_renormalize_sets_the_update_norm(shape):
    """Muon+: the update (before the lr and the tall-matrix scale) has the norm of an exactly semi-orthogonal matrix."""
    lr_eff = 0.1 * max(1.0, shape[0] / shape[1]) ** 0.5
    before, after, *_ = one_step(shape, ns="polar_express", renormalize=True)
    norm = ((before - after) / lr_eff).norm().item()
    assert norm == pytest.approx(min(shape) ** 0.5, rel=1e-5)
    before, after, *_ = one_step(shape, ns="polar_express")
    assert abs(((before - after) / lr_eff).norm().item() - min(shape) ** 0.5) > 1e-3  # without it, another norm


def test_row_equilibrate_makes_row_scale_irrelevant():
    """MuonEq rescales the rows to equal norms before orthogonalising: scaling the gradient's rows changes nothing."""
    g = randn(12, 20, seed=3)
    scaled = g * torch.linspace(0.1, 10.0, 12)[:, None]
    for grad, again in ((g, scaled),):
        a = torch.nn.Parameter(torch.zeros(12, 20))
        b = torch.nn.Parameter(torch.zeros(12, 20))
        a.grad, b.grad = grad, again
        for p in (a, b):
            Muon([p], lr=0.1, momentum=0.0, nesterov=False, ns="polar_express", row_equilibrate=True).step()
        torch.testing.assert_close(a.detach(), b.detach(), atol=1e-5, rtol=0)
        c = torch.nn.Parameter(torch.zeros(12, 20))
        c.grad = again
        Muon([c], lr=0.1, momentum=0.0, nesterov=False, ns="polar_express").step()
        assert (c.detach() - a.detach()).abs().max() > 1e-2  # without MuonEq the row scales do matter


@pytest.mark.parametrize("shape", [(24, 16), (16, 40)])
def test_normuon_evens_out_rows_and_keeps_the_norm(shape):
    """NorMuon's first step (the buffer is (1 - beta2) * this step's mean squares): every row (rows >= cols) or
    column (rows < cols) of the update gets the same RMS, and the update keeps the norm it had without NorMuon."""
    lr_eff = 0.1 * max(1.0, shape[0] / shape[1]) ** 0.5
    before, after, _, opt = one_step(shape, ns="polar_express", normuon=True, beta2=0.9)
    update = (before - after) / lr_eff
    dim = -1 if shape[0] >= shape[1] else -2
    rms = update.square().mean(dim=dim)
    assert (rms.max() / rms.min()).item() == pytest.approx(1.0, abs=1e-4)
    plain_before, plain_after, *_ = one_step(shape, ns="polar_express")
    plain = (plain_before - plain_after) / lr_eff
    assert update.norm().item() == pytest.approx(plain.norm().item(), rel=1e-5)
    plain_rms = plain.square().mean(dim=dim)
    assert (plain_rms.max() / plain_rms.min()).item() > 1.01  # Polar Express alone leaves them uneven
    buf = next(iter(opt.state.values()))["second_momentum_buffer"]
    assert buf.shape == ((shape[0], 1) if dim == -1 else (1, shape[1]))
    torch.testing.assert_close(buf.flatten(), 0.1 * plain.square().mean(dim=dim), rtol=1e-5, atol=0)


def test_cautious_weight_decay_only_where_update_and_weight_agree():
    """p -= lr' * (u + wd * p * [u * p >= 0]): compared with the same step without decay, exactly the elements where
    the update u and p have the same sign are decayed, by lr' * wd * p; plain decay takes every element."""
    shape, lr, wd = (24, 16), 0.1, 0.3
    lr_eff = lr * (24 / 16) ** 0.5
    before, no_decay, *_ = one_step(shape, ns="polar_express", lr=lr)
    _, cautious, *_ = one_step(shape, ns="polar_express", lr=lr, weight_decay=wd, cautious_wd=True)
    _, plain, *_ = one_step(shape, ns="polar_express", lr=lr, weight_decay=wd)
    update = (before - no_decay) / lr_eff
    agree = (update * before) >= 0
    assert 0.2 < agree.float().mean() < 0.8
    decay = no_decay - cautious
    torch.testing.assert_close(decay[agree], lr_eff * wd * before[agree], atol=1e-6, rtol=0)
    assert torch.all(decay[~agree].abs() < 1e-6)
    torch.testing.assert_close(no_decay - plain, lr_eff * wd * before, atol=1e-6, rtol=0)


def test_options_off_keep_the_december_state_and_update():
    """Every option at its default is the December Muon: same update bit for bit, and no state beyond the momentum
    (the optimizer files of December runs keep their format)."""
    a, b = torch.nn.Parameter(randn(24, 16)), torch.nn.Parameter(randn(24, 16))
    opts = [Muon([a], lr=0.05), Muon([b], lr=0.05, ns="quintic", row_equilibrate=False, renormalize=False, normuon=False,
                                      weight_decay=0.0, cautious_wd=True)]
    for step in range(3):
        for p, opt in zip((a, b), opts):
            p.grad = randn(24, 16, seed=10 + step)
            opt.step()
    assert torch.equal(a, b)
    assert set(opts[1].state[b]) == {"momentum_buffer"}


def test_normuon_state_round_trips():
    """A resumed record Muon continues exactly like the uninterrupted one, which needs the saved NorMuon buffers
    (resuming with them dropped does not)."""
    shapes = [(24, 16), (16, 40), (24, 16)]

    def run(resume_at=None, drop=False):
        ps = [torch.nn.Parameter(randn(*s, seed=i)) for i, s in enumerate(shapes)]
        opt = Muon(ps, lr=0.02, weight_decay=0.2, **RECORD_MUON)
        for step in range(5):
            if step == resume_at:
                sd = opt.state_dict()
                if drop:
                    for st in sd["state"].values():
                        del st["second_momentum_buffer"]
                ps = [torch.nn.Parameter(p.detach().clone()) for p in ps]
                opt = Muon(ps, lr=0.02, weight_decay=0.2, **RECORD_MUON)
                opt.load_state_dict(sd)
            for i, p in enumerate(ps):
                p.grad = randn(*p.shape, seed=100 * step + i)
            opt.step()
        return ps

    full = run()
    assert all(torch.equal(a, b) for a, b in zip(full, run(resume_at=2)))
    assert not all(torch.equal(a, b) for a, b in zip(full, run(resume_at=2, drop=True)))


def test_bad_options_are_refused():
    p = [torch.nn.Parameter(torch.zeros(4, 4))]
    for kwargs, match in [(dict(ns="cubic"), "ns must be one of quintic|polar_express"),
                          (dict(ns="polar_express", ns_steps=6), "at most 5 steps"),
                          (dict(beta2=1.0), "beta2"), (dict(weight_decay=-0.1), "weight_decay")]:
        with pytest.raises(ValueError, match=match):
            Muon(p, **kwargs)
    with pytest.raises(ValueError, match="ns must be one of"):  # a param group's own value is checked too
        Muon([dict(params=p, ns="newton")])


# ----------------------------------------------------------------------------- sharded checkpoints (torchrun)


@pytest.fixture(scope="module")
def sharded_record_runs(tmp_path_factory):
    """tests/dist_scripts/sharded_ckpt_check.py --record=1: 2 ranks train the tiny FSDP GPT with the record options
    and save a sharded (DCP) step; 1 and 2 ranks load it and train on."""
    spec = importlib.util.spec_from_file_location("nanochat_test_launch", Path(__file__).parent.parent / "dist_scripts" / "launch.py")
    launch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launch)
    d = tmp_path_factory.mktemp("sharded_record")
    launch.ranks("sharded_ckpt_check.py", ["--mode=save", f"--dir={d}", "--record=1"], nproc=2, timeout=300)
    for n in (1, 2):
        launch.ranks("sharded_ckpt_check.py", ["--mode=load", f"--dir={d}", "--record=1"], nproc=n, timeout=300)
    return d


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [1, 2])
def test_sharded_checkpoint_keeps_the_normuon_state(sharded_record_runs, world):
    """The NorMuon buffers (whole matrices, the same on every rank) are in the sharded step and load on another number
    of ranks unchanged, with every momentum shard and the groups' record options; training goes on as the run that
    never stopped (2 ranks: bit for bit; 1 rank: float32 reduction-order noise, the same global batches, except that
    cautious decay is discontinuous where update * p crosses 0: that noise may flip the mask of a few elements, each
    then off by one decay step lr' * wd * p, ~5e-4 here)."""
    saved = torch.load(sharded_record_runs / "saved.pt", weights_only=False)
    loaded = torch.load(sharded_record_runs / f"loaded_w{world}.pt", weights_only=False)
    second = [k for k in saved["tensors"] if k.endswith("second_momentum_buffer")]
    assert len(second) == 3 * 6  # every block matrix of the 3-layer GPT
    assert list(loaded["tensors"]) == list(saved["tensors"])
    for k, v in saved["tensors"].items():
        assert torch.equal(loaded["tensors"][k], v), k
    assert loaded["groups"] == saved["groups"]
    muon_groups = [g for opt in saved["groups"] for g in opt if "momentum" in g]
    assert muon_groups and all(g["ns"] == "polar_express" and g["normuon"] and g["cautious_wd"] for g in muon_groups)
    ref = torch.load(sharded_record_runs / "continued_w2.pt", weights_only=False)
    got = torch.load(sharded_record_runs / f"continued_w{world}.pt", weights_only=False)
    for k, v in ref["state"]["tensors"].items():
        if world == 2:
            assert torch.equal(got["state"]["tensors"][k], v), k
        else:
            off = ~torch.isclose(got["state"]["tensors"][k], v, atol=2e-5, rtol=1e-4)
            assert off.sum() <= 3 and (got["state"]["tensors"][k] - v).abs().max() < 2e-3, (k, off.sum())
    assert got["losses"] == (ref["losses"] if world == 2 else pytest.approx(ref["losses"], abs=1e-5))


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_consolidated_record_step_is_the_single_file_one(sharded_record_runs, tmp_path):
    """consolidate() turns the sharded step into the files the gather-to-rank-0 path wrote for it, byte for byte: each
    rank's optimizer file holds its momentum rows and the whole NorMuon buffers."""
    import filecmp
    import os

    from nanochat.checkpoint.files import sharded_step_dir
    from nanochat.checkpoint.sharded import consolidate

    written = consolidate(sharded_step_dir(str(sharded_record_runs / "sharded"), 2), str(tmp_path), 2)
    names = sorted(os.path.basename(p) for p in written)
    assert names == sorted(os.listdir(sharded_record_runs / "single"))
    for name in names:
        assert filecmp.cmp(sharded_record_runs / "single" / name, tmp_path / name, shallow=False), name
    rank1 = torch.load(tmp_path / "optim_000002_rank1.pt", weights_only=False)
    assert any("second_momentum_buffer" in st for st in rank1[1]["state"].values())
