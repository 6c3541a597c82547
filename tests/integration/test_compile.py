"""
torch.compile (nanochat/compile.py): the --compile decision, what gets compiled on each path (counted with a custom
backend that records every graph dynamo hands it), graph-break reporting, and one real inductor-compiled training
step on CPU against eager.
"""

import pytest
import torch
import torch.nn.functional as F

from nanochat import compile as C
from nanochat import muon
from nanochat.gpt import GPT, GPTConfig

pytestmark = pytest.mark.cost(0.8)  # seconds per test, in process: the order files are handed out in (conftest.py)


class CountingBackend:
    """A torch.compile backend that runs graphs eagerly and keeps them, to count and inspect them."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def calls(self, graph):
        return [getattr(n.target, "__name__", str(n.target)) for n in graph.graph.nodes if n.op == "call_function"]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    muon.set_compile(False)  # back to the eager default for other tests
    torch._dynamo.reset()


def tiny_model(n_layer=3, seed=0):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(sequence_len=16, vocab_size=64, n_layer=n_layer, n_head=2, n_kv_head=1, n_embd=32), attn="sdpa")
    model.init_weights("nanochat")
    return model


def test_compile_flag_spellings():
    for v in ("auto", "AUTO"):
        assert C.parse_compile_flag(v) == "auto"
    for v in ("1", "True", "true", "yes", True):
        assert C.parse_compile_flag(v) is True
    for v in ("0", "False", "false", "no", False):
        assert C.parse_compile_flag(v) is False
    with pytest.raises(ValueError, match="--compile must be auto, 1 or 0"):
        C.parse_compile_flag("maybe")


def test_env_is_the_flags_default(monkeypatch):
    """NANOCHAT_COMPILE is --compile's default: the parsed flags (what a run records) hold what it does."""
    from nanochat.configurator import FlagError, Flags

    flags = Flags(C.compile_flag())
    monkeypatch.setenv("NANOCHAT_COMPILE", "0")
    assert flags.parse([])["compile"] == "0" and C.resolve_compile(flags.parse([])["compile"], "cpu") is False
    monkeypatch.setenv("NANOCHAT_COMPILE", "1")
    assert flags.parse(["--compile=0"])["compile"] == "0"  # an explicit flag wins
    monkeypatch.setenv("NANOCHAT_COMPILE", "maybe")
    with pytest.raises(FlagError, match=r"NANOCHAT_COMPILE=maybe \(the default of --compile\): --compile must be auto"):
        flags.parse([])
    monkeypatch.delenv("NANOCHAT_COMPILE")
    assert flags.parse([])["compile"] == "auto"
    notes = []
    assert C.resolve_compile("auto", "mps", log=notes.append) is False and "runs eager" in notes[0]


def test_missing_cxx_compiler_falls_back_to_eager_with_a_note(monkeypatch, tmp_path):
    if C.compiler_unavailable_reason("cpu") is not None:
        pytest.skip("this machine has no C++ compiler to take away")
    monkeypatch.delenv("NANOCHAT_COMPILE", raising=False)
    assert C.resolve_compile("auto", "cpu") is True
    # fake its absence: nothing on PATH, no CXX
    import torch._inductor.config as inductor_config

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    with inductor_config.patch({"cpp.cxx": (None, "g++")}):
        assert "no C++ compiler" in C.compiler_unavailable_reason("cpu")
        notes = []
        assert C.resolve_compile("auto", "cpu", log=notes.append) is False
        assert len(notes) == 1 and "no C++ compiler" in notes[0] and "eager" in notes[0]
        with pytest.raises(RuntimeError, match="--compile=1 but torch.compile cannot run here.*--compile=0"):
            C.resolve_compile("1", "cpu")


def test_maybe_compile_is_what_the_scripts_call(monkeypatch):
    monkeypatch.delenv("NANOCHAT_COMPILE", raising=False)
    model = tiny_model()
    assert C.maybe_compile(model, "0", "cpu", 2, 16) is model
    backend, logs = CountingBackend(), []
    compiled = C.maybe_compile(model, "True", "cpu", 2, 16, backend=backend, log=logs.append)
    assert compiled is not model and compiled._orig_mod is model
    assert len(backend.graphs) == 1 and len(logs) == 1 and "cold compile" in logs[0]  # compiled by the warm-up


@pytest.mark.slow  # compiles a model (inductor: seconds of CPU)
def test_ddp_path_is_one_graph_without_breaks():
    backend = CountingBackend()
    model = tiny_model()
    compiled = C.compile_model(model, per_block=False, backend=backend)
    _, breaks = C.warm_up(compiled, 2, 16, 64, "cpu", log=lambda line: None)
    assert not breaks
    for _ in range(2):
        x, y = torch.randint(0, 64, (2, 2, 16)).unbind(0)
        (_, breaks) = C.graph_breaks_during(lambda: compiled(x, y).backward())
        assert not breaks
    assert len(backend.graphs) == 1  # forward+loss in one graph, compiled by the warm-up and reused by the steps
    calls = backend.calls(backend.graphs[0])
    assert "cross_entropy" in calls and calls.count("scaled_dot_product_attention") == 3
    # Muon's Newton-Schulz compiles with it
    opt = muon.Muon([p for p in model.transformer.h.parameters()], lr=0.02)
    opt.step()
    assert any("matmul" in backend.calls(g) or "bmm" in backend.calls(g) for g in backend.graphs[1:])


@pytest.mark.slow  # compiles every block and the head
def test_fsdp_path_compiles_blocks_and_the_head(tmp_path):
    import torch.distributed as dist

    from nanochat.distributed.dist import compute_cleanup
    from nanochat.distributed.fsdp import apply_fsdp

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        backend = CountingBackend()
        model = apply_fsdp(tiny_model(n_layer=10))
        model = C.compile_model(model, per_block=True, backend=backend)
        x = torch.randint(0, 64, (2, 16))
        for _ in range(3):
            (_, breaks) = C.graph_breaks_during(lambda: model(x, x).backward())
            assert not breaks
        # one graph shared by the 10 blocks (FSDP's hooks run between them), one for the head; no recompiles
        assert len(backend.graphs) == 2, [backend.calls(g) for g in backend.graphs]
        head_graphs = [g for g in backend.graphs if "cross_entropy" in backend.calls(g)]
        assert len(head_graphs) == 1 and "tanh" in backend.calls(head_graphs[0]) and "linear" in backend.calls(head_graphs[0])
        assert not any(k.startswith("_orig_mod") or "._orig_mod" in k for k in model.state_dict())  # names unchanged
        with torch.no_grad():  # evaluation/sampling with other shapes runs eager: no recompiles
            model(x[:1, :5])
            model(x[:, :7], x[:, :7])
        assert len(backend.graphs) == 2
    finally:
        compute_cleanup()  # also lets the FSDP mesh's gloo group go at exit (nanochat.distributed.dist.release_process_groups)


def test_graph_breaking_attention_kernel_is_reported(monkeypatch):
    """A stand-in for an FA3 build whose extension call dynamo cannot trace: the warm-up warns and names the cause."""
    from nanochat import attention

    def breaking_fa3(q, k, v):
        torch._dynamo.graph_break()  # what an untraceable extension call does to the graph
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True)
        return y.transpose(1, 2)

    monkeypatch.setitem(attention._FLASH, "fa3", breaking_fa3)
    model = tiny_model()
    model.attn_choice = attention.Attn("fa3", attention.CPU_ORDER, "test stand-in")
    compiled = C.compile_model(model, per_block=False, backend=CountingBackend())
    logs = []
    with pytest.warns(UserWarning, match=r"graph break.*graph_break"):
        _, breaks = C.warm_up(compiled, 2, 16, 64, "cpu", log=logs.append)
    assert sum(breaks.values()) >= 3  # one per layer
    assert any("cold compile" in line for line in logs)
    assert all(p.grad is None for p in model.parameters())  # the warm-up leaves no gradients behind


@pytest.mark.slow  # compiles forward and backward: the slowest test on CPU
def test_compiled_training_step_matches_eager():
    """A real inductor compile on CPU: two training steps (model and Newton-Schulz compiled) match eager."""
    from nanochat import training as T

    if C.compiler_unavailable_reason("cpu") is not None:
        pytest.skip(C.compiler_unavailable_reason("cpu"))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 64, (2, 16), generator=g),) * 2 for _ in range(4)]

    def run(compile_it):
        model = tiny_model(n_layer=2)
        opts = model.setup_optimizers()
        train_model = C.compile_model(model) if compile_it else model
        it = iter(batches)
        losses = [T.train_step(train_model, opts, lambda: next(it), grad_accum_steps=2)[0] for _ in range(2)]
        muon.set_compile(False)
        return losses, model.state_dict()

    eager_losses, eager_sd = run(False)
    compiled_losses, compiled_sd = run(True)
    torch.testing.assert_close(compiled_losses, eager_losses, atol=1e-4, rtol=1e-4)
    for k in eager_sd:
        torch.testing.assert_close(compiled_sd[k], eager_sd[k], atol=1e-4, rtol=1e-3)
