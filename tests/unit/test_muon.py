"""Muon's math (nanochat/muon.py) in one process: orthogonalisation quality, orientation, batching, update scale."""

import pytest
import torch

from nanochat.muon import Muon, muon_update, zeropower_via_newtonschulz5, zeropower_via_polar_express


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", [(32, 64), (64, 32), (48, 48), (8, 200)])
def test_singular_values_near_one(shape):
    G = randn(*shape)
    X = zeropower_via_newtonschulz5(G, steps=5)
    assert X.shape == G.shape and X.dtype == torch.float32  # fp32 on CPU
    s = torch.linalg.svdvals(X)
    # the quintic's coefficients trade exact convergence for speed: singular values land in roughly [0.68, 1.2]
    # (Keller Jordan's design: a steep slope at 0 matters more than converging to exactly 1)
    assert s.min() > 0.6 and s.max() < 1.25, s
    assert 0.75 < s.mean().item() < 1.15, s
    # and it points where the exact orthogonal factor U V^T points
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    cos = (X * (U @ Vh)).sum() / (X.norm() * (U @ Vh).norm())
    assert cos > 0.97


def test_more_steps_do_not_undo_it():
    G = randn(40, 24, seed=3)
    s1 = torch.linalg.svdvals(zeropower_via_newtonschulz5(G, steps=1))
    s5 = torch.linalg.svdvals(zeropower_via_newtonschulz5(G, steps=5))
    # one step leaves the small singular values far from 1, five bring them close
    assert (s5 - 1).abs().max() < (s1 - 1).abs().max()


def test_tall_is_transpose_of_wide():
    G = randn(20, 50, seed=1)
    assert torch.allclose(zeropower_via_newtonschulz5(G.T), zeropower_via_newtonschulz5(G).T, atol=1e-6)


def test_batched_equals_one_by_one():
    G = randn(3, 16, 24, seed=2)
    batched = zeropower_via_newtonschulz5(G)
    for i in range(3):
        assert torch.allclose(batched[i], zeropower_via_newtonschulz5(G[i]), atol=1e-5)


def test_input_scale_does_not_matter():
    G = randn(16, 32, seed=4)
    assert torch.allclose(zeropower_via_newtonschulz5(G), zeropower_via_newtonschulz5(G * 1000.0), atol=1e-5)


def test_rejects_vectors():
    with pytest.raises(ValueError, match="matrix"):
        zeropower_via_newtonschulz5(torch.ones(5))


def test_update_scale():
    """sqrt(max(1, rows/cols)): a tall matrix's update is the transposed wide update times sqrt(rows/cols), so per
    element it moves as much as a wide one (whose update is not scaled)."""
    g = randn(128, 32, seed=5)
    tall = muon_update(g, torch.zeros(128, 32), momentum=0.0, nesterov=False, ns_steps=5)
    wide = muon_update(g.T.contiguous(), torch.zeros(32, 128), momentum=0.0, nesterov=False, ns_steps=5)
    assert torch.allclose(tall, wide.T * 2.0, atol=1e-6)  # sqrt(128/32) = 2
    assert torch.allclose(wide, zeropower_via_newtonschulz5(g.T), atol=1e-6)  # wide: no scaling
    # RMS of the unscaled singular values ~1 => Frobenius norm of the wide update ~ sqrt(32)
    assert 0.7 < wide.norm().item() / 32**0.5 < 1.15


def test_muon_step_is_nesterov_momentum_then_orthogonalise():
    """Muon's step against the update written out by hand: buf = m*buf + (1-m)*g; d = (1-m)*g + m*buf."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(randn(24, 16, seed=6))
    start = p.detach().clone()
    opt = Muon([p], lr=0.05, momentum=0.9)
    buf = torch.zeros(24, 16)
    expected = start.clone()
    for step in range(3):
        g = randn(24, 16, seed=10 + step)
        p.grad = g.clone()
        opt.step()
        buf = 0.9 * buf + 0.1 * g
        d = 0.1 * g + 0.9 * buf
        expected = expected - 0.05 * zeropower_via_newtonschulz5(d) * (24 / 16) ** 0.5
        assert torch.allclose(p.detach(), expected, atol=1e-5), step
    assert torch.allclose(opt.state[p]["momentum_buffer"], buf, atol=1e-6)


def test_muon_groups_by_shape_and_follows_group_settings():
    ps = [torch.nn.Parameter(torch.zeros(s)) for s in [(4, 8), (8, 4), (4, 8), (3, 3)]]
    opt = Muon(ps, lr=0.01)
    shapes = [tuple(g["params"][0].shape) for g in opt.param_groups]
    assert shapes == sorted(shapes) and len(shapes) == 3
    assert sum(len(g["params"]) for g in opt.param_groups) == 4
    for g in opt.param_groups:
        assert len({tuple(p.shape) for p in g["params"]}) == 1
    # lr set on the group (as the training loop's schedule does) is what the step uses
    for g in opt.param_groups:
        g["lr"] = 0.0
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    assert all(torch.equal(p, torch.zeros_like(p)) for p in ps)


def test_muon_step_runs_the_closure_with_grad_and_skips_params_without_grad():
    """torch.optim's closure protocol (nanochat/optim/base.py run_closure): step() runs under no_grad, the closure
    with autograd on; its loss is returned and the gradients it makes are the ones used. A matrix with no gradient
    keeps its value and gets no state."""
    p, idle = torch.nn.Parameter(randn(6, 4, seed=1)), torch.nn.Parameter(randn(6, 4, seed=2))
    start, idle_start = p.detach().clone(), idle.detach().clone()
    opt = Muon([p, idle], lr=0.05, momentum=0.9)

    def closure():
        opt.zero_grad()
        loss = (p * randn(6, 4, seed=3)).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert torch.is_tensor(loss) and loss.requires_grad
    assert torch.equal(p.grad, randn(6, 4, seed=3))
    assert not torch.equal(p.detach(), start) and torch.equal(idle.detach(), idle_start)
    assert idle not in opt.state and opt.step() is None


def test_muon_rejects_non_matrices_and_bad_hparams():
    with pytest.raises(ValueError, match="2-D"):
        Muon([torch.nn.Parameter(torch.zeros(5))])
    with pytest.raises(ValueError, match="momentum"):
        Muon([torch.nn.Parameter(torch.zeros(2, 2))], momentum=1.5)


def test_muon_state_dict_round_trip():
    def run(steps, resume_at=None):
        p = torch.nn.Parameter(randn(6, 10, seed=7))
        opt = Muon([p], lr=0.02)
        for s in range(steps):
            if s == resume_at:
                sd = opt.state_dict()
                p = torch.nn.Parameter(p.detach().clone())
                opt = Muon([p], lr=0.02)
                opt.load_state_dict(sd)
            p.grad = randn(6, 10, seed=100 + s)
            opt.step()
        return p.detach()

    assert torch.equal(run(5), run(5, resume_at=2))


@pytest.mark.parametrize("zeropower", [zeropower_via_newtonschulz5, zeropower_via_polar_express])
def test_compiled_newton_schulz_matches_eager_and_switches_back(zeropower):
    from nanochat import muon

    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    G = randn(3, 24, 40, seed=5)
    eager = zeropower(G)
    torch._dynamo.reset()
    muon.set_compile(True, backend=counting)
    try:
        compiled = zeropower(G)
        zeropower(randn(3, 24, 40, seed=6))  # same shape: the graph is reused
    finally:
        muon.set_compile(False)
    assert len(graphs) == 1
    torch.testing.assert_close(compiled, eager)
    zeropower(G)  # eager again: no new graph
    assert len(graphs) == 1
    torch._dynamo.reset()
