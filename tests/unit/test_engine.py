"""
Engine and KVCache against a real (tiny, random-init) GPT and a real RustBPE tokenizer: the cache gives the same
logits and greedy tokens as recomputing the whole sequence, rows sample independently, seeds reproduce, and the
calculator tool's output is forced into the stream.
"""

import pytest
import torch

from chat_fixtures import ScriptedModel, greedy_by_recompute, tiny_model, tiny_tokenizer
from nanochat.engine import Engine, KVCache, sample_next_token, sample_rows


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_model(tok.get_vocab_size(), depth=2, sequence_len=64)


def prompt_ids(tok, text="The history of the castle"):
    return tok.encode(text, prepend=tok.get_bos_token_id())


def stop_ids(tok):
    return {tok.encode_special("<|assistant_end|>"), tok.get_bos_token_id()}


# -----------------------------------------------------------------------------
# KVCache


def test_kvcache_insert_tracks_position_and_grows():
    torch.manual_seed(0)
    L, B, H, D = 3, 2, 2, 4
    cache = KVCache(batch_size=B, num_heads=H, seq_len=3, head_dim=D, num_layers=L)
    assert cache.get_pos() == 0
    all_k = [[] for _ in range(L)]
    all_v = [[] for _ in range(L)]
    for t_new in (2, 1, 4, 1):  # 8 tokens in all: outgrows the initial capacity of 3
        for layer in range(L):
            k, v = torch.randn(B, H, t_new, D), torch.randn(B, H, t_new, D)
            all_k[layer].append(k)
            all_v[layer].append(v)
            k_all, v_all = cache.insert_kv(layer, k, v)
            # position advances only after the last layer
            expected_pos = sum(x.size(2) for x in all_k[layer]) - (t_new if layer < L - 1 else 0)
            assert cache.get_pos() == expected_pos
            assert torch.equal(k_all, torch.cat(all_k[layer], dim=2))
            assert torch.equal(v_all, torch.cat(all_v[layer], dim=2))
    assert cache.get_pos() == 8
    assert cache.seq_len >= 8 and cache.kv_cache.shape == (L, 2, B, H, cache.seq_len, D)
    cache.reset()
    assert cache.get_pos() == 0
    with pytest.raises(ValueError, match="KVCache holds"):
        cache.insert_kv(0, torch.randn(B + 1, H, 1, D), torch.randn(B + 1, H, 1, D))


def test_kvcache_prefill_copies_one_row_into_many():
    torch.manual_seed(0)
    src = KVCache(batch_size=1, num_heads=2, seq_len=5, head_dim=4, num_layers=2)
    for layer in range(2):
        src.insert_kv(layer, torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4))
    dst = KVCache(batch_size=3, num_heads=2, seq_len=2, head_dim=4, num_layers=2)  # too small: must grow
    dst.prefill(src)
    assert dst.get_pos() == 5
    for row in range(3):
        assert torch.equal(dst.kv_cache[:, :, row, :, :5], src.kv_cache[:, :, 0, :, :5])
    with pytest.raises(ValueError, match="empty cache"):
        dst.prefill(src)
    other = KVCache(batch_size=3, num_heads=1, seq_len=5, head_dim=4, num_layers=2)
    with pytest.raises(ValueError, match="cache shapes differ"):
        other.prefill(src)


def test_cached_logits_match_full_recompute(model, tok):
    # prefill a chunk, then a second chunk (attends to the cached prefix, causal inside), then single tokens;
    # start with a 2-token cache so it has to grow along the way
    ids = prompt_ids(tok, "Robert Boulter is an English film and television actor")
    ids = torch.tensor([ids[:20]])
    cfg = model.config
    with torch.inference_mode():
        full = model(ids)
        cache = KVCache(1, cfg.n_kv_head, 2, cfg.n_embd // cfg.n_head, cfg.n_layer)
        pieces = [model(ids[:, :8], kv_cache=cache), model(ids[:, 8:13], kv_cache=cache)]
        for t in range(13, ids.size(1)):
            pieces.append(model(ids[:, t : t + 1], kv_cache=cache))
    cached = torch.cat(pieces, dim=1)
    assert cache.get_pos() == ids.size(1)
    torch.testing.assert_close(cached, full, atol=1e-4, rtol=1e-4)


# -----------------------------------------------------------------------------
# Engine


@pytest.mark.parametrize("text", ["The history of the castle", "In 1990 , the team"])
def test_greedy_cached_generation_matches_recompute(model, tok, text):
    engine = Engine(model, tok)
    tokens = prompt_ids(tok, text)
    reference = greedy_by_recompute(model, tokens, 30, stop_ids(tok))
    sequences, masks = engine.generate_batch(tokens, num_samples=3, max_tokens=30, temperature=0.0)
    assert len(reference) > len(tokens)
    for seq, mask in zip(sequences, masks):
        assert seq == reference
        assert mask == [0] * len(tokens) + [1] * (len(seq) - len(tokens))


@pytest.mark.slow  # 100 tokens generated twice, by recompute and with the cache
def test_generation_past_the_initial_cache_size(model, tok):
    # the engine reserves up to sequence_len (64 here) positions for the reply and grows the cache beyond that
    engine = Engine(model, tok)
    tokens = prompt_ids(tok, "The castle was built in")
    reference = greedy_by_recompute(model, tokens, 100, stop_ids(tok))
    assert len(reference) - len(tokens) > model.config.sequence_len  # precondition: the reply outgrows the cache
    sequences, _ = engine.generate_batch(tokens, num_samples=2, max_tokens=100, temperature=0.0)
    assert sequences == [reference, reference]


def test_streaming_matches_batch(model, tok):
    engine = Engine(model, tok)
    tokens = prompt_ids(tok)
    columns = list(engine.generate(tokens, num_samples=2, max_tokens=12, temperature=0.9, seed=7))
    assert 1 <= len(columns) <= 12
    assert all(len(col) == 2 and masks == [1, 1] for col, masks in columns)
    sequences, _ = engine.generate_batch(tokens, num_samples=2, max_tokens=12, temperature=0.9, seed=7)
    stops = stop_ids(tok)
    for row in range(2):
        streamed = []
        for col, _ in columns:
            if col[row] in stops:
                break
            streamed.append(col[row])
        assert sequences[row] == tokens + streamed


def test_seeds_reproduce(model, tok):
    engine = Engine(model, tok)
    tokens = prompt_ids(tok)
    kw = dict(num_samples=4, max_tokens=16, temperature=1.0, top_k=50)
    a, _ = engine.generate_batch(tokens, seed=123, **kw)
    b, _ = engine.generate_batch(tokens, seed=123, **kw)
    c, _ = engine.generate_batch(tokens, seed=124, **kw)
    assert a == b
    assert a != c


def test_rows_sample_independently_from_the_first_token(model, tok):
    engine = Engine(model, tok)
    tokens = prompt_ids(tok)
    (first_column, first_masks), *_ = engine.generate(tokens, num_samples=48, max_tokens=1, temperature=2.0)
    assert first_masks == [1] * 48
    assert len(set(first_column)) > 5, "rows drew the same first token: the first sample was broadcast"
    # the empirical distribution of first tokens follows the model's softmax: the most likely token appears about
    # as often as its probability says (loose bound: this is a check on independence, not on the sampler's RNG)
    with torch.inference_mode():
        probs = torch.softmax(model(torch.tensor([tokens]))[0, -1] / 2.0, dim=-1)
    (col, _), *_ = engine.generate(tokens, num_samples=2000, max_tokens=1, temperature=2.0, seed=3)
    top = int(probs.argmax())
    freq = col.count(top) / len(col)
    p = float(probs[top])
    assert abs(freq - p) < 5 * (p * (1 - p) / len(col)) ** 0.5 + 1e-3


def test_top_k_and_top_p_restrict_the_choice(model, tok):
    engine = Engine(model, tok)
    tokens = prompt_ids(tok)
    with torch.inference_mode():
        logits = model(torch.tensor([tokens]))[0, -1]
    top5 = set(torch.topk(logits, 5).indices.tolist())
    (col, _), *_ = engine.generate(tokens, num_samples=200, max_tokens=1, temperature=1.5, top_k=5)
    assert set(col) <= top5 and len(set(col)) > 1
    (col, _), *_ = engine.generate(tokens, num_samples=50, max_tokens=1, temperature=1.5, top_k=1)
    assert set(col) == {int(logits.argmax())}
    (col, _), *_ = engine.generate(tokens, num_samples=50, max_tokens=1, temperature=1.5, top_p=1e-6)
    assert set(col) == {int(logits.argmax())}
    # top_p keeps the smallest set of most likely tokens whose mass reaches p
    probs = torch.softmax(logits / 1.5, dim=-1)
    sorted_p, order = probs.sort(descending=True)
    n_keep = int((sorted_p.cumsum(0) < 0.5).sum()) + 1
    (col, _), *_ = engine.generate(tokens, num_samples=300, max_tokens=1, temperature=1.5, top_p=0.5)
    assert set(col) <= set(order[:n_keep].tolist())


def test_sample_next_token_leaves_logits_untouched():
    logits = torch.randn(3, 10)
    before = logits.clone()
    rng = torch.Generator().manual_seed(0)
    out = sample_next_token(logits, rng, temperature=0.7, top_k=3, top_p=0.9)
    assert out.shape == (3, 1) and out.dtype == torch.long
    assert torch.equal(logits, before)


def reference_probs(logits, temperature, top_k, top_p):
    """The distribution sample_rows draws from, over the whole vocabulary, written out plainly: tokens ranked most
    likely first, equal logits by token id; top_k keeps the first k, top_p the first ones until their mass reaches p
    (sample_next_token's filters, with its arbitrary order of equal logits made the ids')."""
    rank = sorted(range(logits.numel()), key=lambda i: (-logits[i].item(), i))
    if top_k:
        rank = rank[:top_k]
    probs = torch.zeros(logits.numel(), dtype=torch.float64)
    probs[rank] = (logits.double()[rank] / temperature).softmax(-1)
    if top_p is not None and top_p < 1:
        before = 0.0
        for i in rank:
            p, probs[i] = probs[i].item(), probs[i] if before < top_p else 0.0
            before += p
        probs /= probs.sum()
    return probs


@pytest.mark.parametrize("tied", [False, True], ids=["distinct", "tied"])
@pytest.mark.parametrize("settings", [(1.0, None, None), (0.7, 5, None), (1.5, None, 0.8), (1.2, 20, 0.6)])
def test_sample_rows_draws_each_token_with_its_probability(settings, tied):
    """Inverse transform: over N evenly spaced uniforms, each token is drawn N x its probability times (+-1), with
    the temperature, top_k and top_p of sample_next_token; nothing outside the kept set is ever drawn. Tied: many
    equal logits (as bf16 gives), so the k-th place and the nucleus's edge fall among equal ones."""
    temperature, top_k, top_p = settings
    torch.manual_seed(0)
    logits = (torch.randn(64) * 2).round() if tied else torch.randn(64) * 2
    N = 4000
    u = (torch.arange(N, dtype=torch.float64) + 0.5) / N
    got = sample_rows(logits.expand(N, -1), u, [temperature] * N, [top_k] * N, [top_p] * N)
    counts = torch.bincount(got, minlength=64).double()
    expected = reference_probs(logits, temperature, top_k, top_p) * N
    assert (counts - expected).abs().max() <= 1.0 + 1e-6, (counts - expected).abs().max()
    assert counts[expected == 0].sum() == 0


def test_sample_rows_gives_a_row_its_token_whatever_the_other_rows():
    """Each row alone == the same row in a batch of rows with other settings, with many equal logits (bf16 logits
    have them; a sort may order them differently in another batch): the scheduler's seeded requests never depend
    on their neighbours. A uniform that rounds up to 1 takes the most likely token, never a dropped one."""
    torch.manual_seed(1)
    settings = [(1.0, None, None), (0.5, 3, None), (1.3, None, 0.9), (0.9, 50, 0.5), (2.0, 99, None), (1.0, 1, None),
                (0.8, None, 0.3)]
    tied = (torch.randn(7, 100) * 3).round()
    for trial in range(20):
        u = torch.rand(7, dtype=torch.float64)
        together = sample_rows(tied, u, *[list(x) for x in zip(*settings)])
        for i, (t, k, p) in enumerate(settings):
            assert sample_rows(tied[i:i + 1], u[i:i + 1], [t], [k], [p]).item() == together[i].item(), (trial, i)
    logits = torch.randn(7, 100) * 3
    last = sample_rows(logits, torch.full((7,), 1 - 1e-12, dtype=torch.float64), *[list(x) for x in zip(*settings)])
    for i, (t, k, p) in enumerate(settings):
        assert reference_probs(logits[i], t, k, p)[last[i]] > 0, i


def test_a_vanishing_temperature_is_greedy_not_nan():
    # logits / 1e-40 overflow to inf in float32 and softmax(inf - inf) is NaN: multinomial would raise
    logits = torch.randn(4, 50) * 10
    rng = torch.Generator().manual_seed(0)
    for t in (1e-40, 1e-20, 1e-6):
        assert torch.equal(sample_next_token(logits, rng, temperature=t), logits.argmax(-1, keepdim=True)), t
        assert torch.equal(sample_next_token(logits, rng, temperature=t, top_k=5, top_p=0.5), logits.argmax(-1, keepdim=True)), t


def test_bad_arguments_are_refused_clearly(model, tok):
    engine = Engine(model, tok)
    with pytest.raises(ValueError, match="non-empty list"):
        list(engine.generate([]))
    with pytest.raises(ValueError, match="temperature"):
        list(engine.generate([1, 2], temperature=-1))
    with pytest.raises(ValueError, match="no room"):
        list(engine.generate([1] * engine.max_positions()))
    assert list(engine.generate([1, 2], max_tokens=0)) == []


# -----------------------------------------------------------------------------
# Stop tokens and the calculator tool, with a scripted model: its next-token choice is fixed per position, so the
# test decides exactly what the "model" writes and checks what the engine does with it.


def test_calculator_output_is_forced_into_the_stream(tok):
    prompt = prompt_ids(tok, "What is 12 times 7?")
    py_start, py_end = tok.encode_special("<|python_start|>"), tok.encode_special("<|python_end|>")
    out_start, out_end = tok.encode_special("<|output_start|>"), tok.encode_special("<|output_end|>")
    end = tok.encode_special("<|assistant_end|>")
    expr = tok.encode("12*7")
    answer = tok.encode("84")
    filler = tok.encode("x")[0]
    # what the model "wants" to write; during the forced tool output it wants `filler`, which must be overridden
    script = [py_start, *expr, py_end] + [filler] * (len(answer) + 2) + [*tok.encode(" so"), end]
    model = ScriptedModel(tok.get_vocab_size(), script, filler)
    engine = Engine(model, tok)
    sequences, masks = engine.generate_batch(prompt, num_samples=2, max_tokens=40, temperature=1.0)
    expected = prompt + [py_start, *expr, py_end, out_start, *answer, out_end, *tok.encode(" so")]
    expected_mask = [0] * len(prompt) + [1] * (len(expr) + 2) + [0] * (len(answer) + 2) + [1] * len(tok.encode(" so"))
    for seq, mask in zip(sequences, masks):
        assert seq == expected
        assert mask == expected_mask
    assert "<|output_start|>84<|output_end|>" in tok.decode(sequences[0])
    # the forced tokens were fed back to the model (it conditions on the tool's answer)
    assert [step[0][0] for step in model.fed[1:]] == expected[len(prompt) :]


def test_calculator_refuses_code_written_by_the_model(tok):
    prompt = prompt_ids(tok, "hi")
    py_start, py_end = tok.encode_special("<|python_start|>"), tok.encode_special("<|python_end|>")
    end = tok.encode_special("<|assistant_end|>")
    code = tok.encode("__import__('os').getcwd()")
    script = [py_start, *code, py_end, end]
    model = ScriptedModel(tok.get_vocab_size(), script, end)
    sequences, masks = Engine(model, tok).generate_batch(prompt, max_tokens=60, temperature=0.0)
    assert sequences[0] == prompt + [py_start, *code, py_end]  # no <|output_start|>: nothing was evaluated
    assert 0 not in masks[0][len(prompt) :]


def test_each_row_stops_on_its_own(tok):
    # at the first step half the mass is on <|assistant_end|> (or <|bos|>), half on a word: rows split, finished
    # rows stop and the others run on to max_tokens
    prompt = prompt_ids(tok, "hi")
    end, bos = tok.encode_special("<|assistant_end|>"), tok.get_bos_token_id()
    word = tok.encode("the")[0]
    for stop in (end, bos):
        model = ScriptedModel(tok.get_vocab_size(), [(stop, word)], word)
        sequences, masks = Engine(model, tok).generate_batch(prompt, num_samples=32, max_tokens=5, seed=1)
        lengths = sorted(len(s) - len(prompt) for s in sequences)
        assert set(lengths) == {0, 5}, lengths
        for s in sequences:
            assert stop not in s[len(prompt) :]


# -----------------------------------------------------------------------------
# The terminal chat, end to end from a saved checkpoint


@pytest.mark.slow  # two interpreter start-ups with torch
def test_chat_cli_one_shot_and_interactive(base_dir):
    import subprocess
    import sys
    from dataclasses import asdict

    from conftest import subprocess_env

    from nanochat.checkpoint_manager import save_checkpoint
    from nanochat.tokenizer import get_tokenizer

    tok = get_tokenizer()
    m = tiny_model(tok.get_vocab_size(), depth=1, sequence_len=64, seed=4)
    save_checkpoint(str(base_dir / "chatsft_checkpoints" / "d1"), 5, m.state_dict(), None, {"model_config": asdict(m.config)})
    special = tok.encode_special
    stops = stop_ids(tok)

    def turn(history, text):
        prompt = history + [special("<|user_start|>"), *tok.encode(text), special("<|user_end|>"), special("<|assistant_start|>")]
        seq = greedy_by_recompute(m, prompt, 12, stops)
        return tok.decode(seq[len(prompt) :]), seq + [special("<|assistant_end|>")]

    bos = [tok.get_bos_token_id()]
    reply1, history = turn(bos, "Hello there")
    reply2, _ = turn(history, "Tell me more")
    assert reply1 and reply2 and reply1 != reply2  # preconditions for the checks below to mean something

    cmd = [sys.executable, "-m", "scripts.chat_cli", "-i", "sft", "-t", "0", "-m", "12", "--device_type", "cpu"]
    env = subprocess_env(base_dir)
    one = subprocess.run(cmd + ["-p", "Hello there"], env=env, capture_output=True, text=True, timeout=240)
    assert one.returncode == 0, one.stderr
    assert one.stdout == reply1 + "\n"

    # the conversation is kept between turns; `clear` starts over; `quit` leaves
    stdin = "Hello there\nTell me more\nclear\nHello there\nquit\n"
    chat = subprocess.run(cmd, input=stdin, env=env, capture_output=True, text=True, timeout=240)
    assert chat.returncode == 0, chat.stderr
    replies = [part.split("\n\nUser: ")[0] for part in chat.stdout.split("\nAssistant: ")[1:]]
    assert replies == [reply1, reply2, reply1]
    assert "Conversation cleared." in chat.stdout


def test_kv_cache_stays_bf16_under_autocast_with_fp32_rms_norm(model, tok, monkeypatch):
    """torch >= 2.12 CUDA autocast runs F.rms_norm in fp32; the model keeps k (and so the cache) in bf16 anyway.
    Stand-in on CPU: rms_norm patched to return fp32, bf16 autocast."""
    import torch.nn.functional as F

    real = F.rms_norm
    monkeypatch.setattr(F, "rms_norm", lambda x, shape, *a, **kw: real(x, shape, *a, **kw).float())
    dtypes = []
    real_allocate = KVCache._allocate
    monkeypatch.setattr(KVCache, "_allocate", lambda self, dtype, device: dtypes.append(dtype) or real_allocate(self, dtype, device))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        seqs, _ = Engine(model, tok).generate_batch(prompt_ids(tok), num_samples=2, max_tokens=4, temperature=1.0)
    assert len(seqs) == 2 and dtypes and all(d == torch.bfloat16 for d in dtypes), dtypes


# -----------------------------------------------------------------------------
# The decode step on a static cache, compiled (on CUDA it is also captured as a CUDA graph)


def test_decode_compile_choice():
    from nanochat.engine import resolve_decode_compile

    gpt = tiny_model(64, depth=1, sequence_len=16)
    assert resolve_decode_compile("auto", gpt) is False  # CPU: measured no faster than eager (docs/benchmarks.md)
    assert resolve_decode_compile("1", gpt) is True and resolve_decode_compile("0", gpt) is False
    assert resolve_decode_compile("1", ScriptedModel(64, [], 0)) is False  # a stand-in model always runs eager
    with pytest.raises(ValueError, match="--decode_compile must be auto, 1 or 0"):
        resolve_decode_compile("yes please", gpt)


def test_cache_is_allocated_once_at_prefill(model, tok, monkeypatch):
    # one allocation for the prefill, one for the reply's rows: none while decoding, eager or fixed-shape
    for decode_compile in ("0", "1"):
        sizes = []
        real_allocate = KVCache._allocate
        monkeypatch.setattr(KVCache, "_allocate", lambda self, dtype, device: sizes.append(self.seq_len) or real_allocate(self, dtype, device))
        engine = Engine(model, tok, decode_compile=decode_compile)
        if decode_compile == "1":
            engine._compiled_step = lambda m, ids, cache: m(ids, kv_cache=cache)[:, -1, :]  # fixed shapes, eager (fast)
        tokens = prompt_ids(tok)
        ptrs = []
        real_insert = KVCache.insert_kv
        monkeypatch.setattr(KVCache, "insert_kv", lambda self, layer, *a: ptrs.append(storage_ptr(self, layer)) or real_insert(self, layer, *a))
        L = model.config.n_layer
        replies = []
        for seed in (0, 1):
            ptrs.clear()
            engine.generate_batch(tokens, num_samples=3, max_tokens=12, temperature=1.0, seed=seed)
            decode_ptrs = ptrs[L:]  # after the prefill's inserts (into its own cache), every step writes the same storage
            assert len(decode_ptrs) == 11 * L and all(decode_ptrs[i] == decode_ptrs[i % L] for i in range(len(decode_ptrs)))
            replies.append(decode_ptrs[:L])
        assert len(sizes) == 4 and sizes[1] >= len(tokens) + 12, sizes  # per reply: the prefill's and the rows' cache
        if decode_compile == "1":  # the fixed-shape storage is kept: a CUDA graph finds its inputs where they were
            assert replies[0] == replies[1]
        monkeypatch.undo()


def storage_ptr(cache, layer):
    if cache.fixed:
        return cache.layers[layer].data_ptr()
    return cache.kv_cache.data_ptr() if cache.kv_cache is not None else None


def scripted_sampler(script):
    """A stand-in for sample_next_token that writes `script` (one token per step, all rows) and records the logits."""
    seen, it = [], iter(script)

    def sample(logits, rng, temperature=1.0, top_k=None, top_p=None):
        seen.append(logits.float().clone())
        return torch.full((logits.size(0), 1), next(it), dtype=torch.long, device=logits.device)
    return sample, seen


@pytest.mark.slow  # inductor compiles the decode step of the tiny model (~20 s on 2 cores)
def test_compiled_decode_step_matches_eager(model, tok, monkeypatch):
    tokens = prompt_ids(tok)
    eager, compiled = Engine(model, tok, decode_compile="0"), Engine(model, tok, decode_compile="1")
    assert compiled.decode_compiled and not eager.decode_compiled
    # same tokens at temperature 0, and the same samples for a fixed seed (top-k and top-p too)
    for kw in (dict(temperature=0.0), dict(temperature=1.0, seed=5), dict(temperature=0.8, top_k=20, seed=6),
               dict(temperature=1.0, top_p=0.9, seed=7)):
        a, ma = eager.generate_batch(tokens, num_samples=3, max_tokens=24, **kw)
        b, mb = compiled.generate_batch(tokens, num_samples=3, max_tokens=24, **kw)
        assert (a, ma) == (b, mb), kw
    # the calculator through the compiled step: the forced answer is what the compiled step is fed (its logits at
    # every step equal the eager step's, which sees the same forced tokens)
    py_start, py_end = tok.encode_special("<|python_start|>"), tok.encode_special("<|python_end|>")
    out_start, out_end = tok.encode_special("<|output_start|>"), tok.encode_special("<|output_end|>")
    end, filler = tok.encode_special("<|assistant_end|>"), tok.encode("x")[0]
    expr, answer = tok.encode("12*7"), tok.encode("84")
    script = [py_start, *expr, py_end] + [filler] * (len(answer) + 2) + [end]
    logits = {}
    for name, engine in (("eager", eager), ("compiled", compiled)):
        sample, logits[name] = scripted_sampler(script)
        monkeypatch.setattr("nanochat.engine.sample_next_token", sample)
        seqs, masks = engine.generate_batch(tokens, num_samples=2, max_tokens=30)
        assert seqs[0] == tokens + [py_start, *expr, py_end, out_start, *answer, out_end], name
        assert masks[0][len(tokens):] == [1] * (len(expr) + 2) + [0] * (len(answer) + 2)
    assert len(logits["eager"]) == len(logits["compiled"]) == len(script)
    for a, b in zip(logits["eager"], logits["compiled"]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.slow  # 300 tokens, twice
def test_fixed_shape_reply_past_the_cache_goes_on_eagerly(model, tok):
    # max_tokens=None: the cache is sized for sequence_len (64) more tokens, rounded up to 256 slots; a longer reply
    # fills it, and generation goes on with the growable cache, giving the eager engine's tokens
    tokens = prompt_ids(tok, "The castle was built in")
    fixed = Engine(model, tok, decode_compile="1")
    fixed._compiled_step = lambda m, ids, cache: m(ids, kv_cache=cache)[:, -1, :]  # fixed shapes, run eagerly (fast)
    a, _ = Engine(model, tok, decode_compile="0").generate_batch(tokens, max_tokens=300, temperature=0.0)
    b, _ = fixed.generate_batch(tokens, max_tokens=300, temperature=0.0)
    assert len(a[0]) > 256  # precondition: the reply outgrew the fixed cache
    assert a == b


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphed_decode_matches_eager(tok):
    # fp32 weights, no autocast, TF32 off (torch's default): the graphed step gives the eager tokens and samples
    model = tiny_model(tok.get_vocab_size(), depth=2, sequence_len=64).cuda()
    model.init_buffers()
    tokens = prompt_ids(tok)
    eager, graphed = Engine(model, tok, decode_compile="0"), Engine(model, tok, decode_compile="auto")
    assert graphed.decode_compiled
    for kw in (dict(temperature=0.0), dict(temperature=1.0, top_k=20, seed=3)):
        a = eager.generate_batch(tokens, num_samples=4, max_tokens=32, **kw)
        b = graphed.generate_batch(tokens, num_samples=4, max_tokens=32, **kw)
        c = graphed.generate_batch(tokens, num_samples=4, max_tokens=32, **kw)  # a second reply replays the graph
        assert a == b == c, kw


def test_fixed_shape_step_equals_the_sliced_step_whatever_the_unfilled_slots_hold(model, tok):
    # the reply's cache is torch.empty: whatever its unfilled slots hold (NaN here) must not reach the output of the
    # masked fixed-shape step (a masked NaN would: 0 * NaN), which must equal the eager step on the filled slots
    cfg = model.config
    ids = torch.tensor([prompt_ids(tok)])
    with torch.inference_mode():
        caches = []
        for _ in range(2):
            cache = KVCache(1, cfg.n_kv_head, 256, cfg.n_embd // cfg.n_head, cfg.n_layer)
            model(ids, kv_cache=cache)
            cache.kv_cache[..., cache.get_pos():, :] = float("nan")
            caches.append(cache)
        eager, fixed = caches
        fixed.start_fixed_shape()
        nxt = torch.tensor([[5]])
        for _ in range(3):
            a = model(nxt, kv_cache=eager)
            b = model(nxt, kv_cache=fixed)
            fixed.advance(1)
            assert torch.isfinite(b).all()
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        assert fixed.get_pos() == eager.get_pos() and fixed.pos_t.item() == eager.get_pos()


def test_a_new_thread_gets_its_own_cuda_graph_state():
    """prepare_thread_for_cuda_graphs: a thread other than the one that imported CUDA graph trees has no state for
    them (torch 2.11's cudagraph_trees.get_obj then asserts, as a chat_web worker thread did on an H100); after the
    call it has its own, found where get_obj looks (the thread-local and the TLS stash), and a second call keeps it."""
    import threading

    from torch._inductor import cudagraph_trees as trees

    from nanochat.engine import prepare_thread_for_cuda_graphs

    main = trees.get_obj(trees.local, "tree_manager_containers")
    seen = {}

    def probe():
        seen["before"] = hasattr(trees.local, "tree_manager_containers") or torch._C._is_key_in_tls("tree_manager_containers")
        prepare_thread_for_cuda_graphs()
        first = trees.local.tree_manager_containers
        prepare_thread_for_cuda_graphs()
        seen["kept"] = trees.local.tree_manager_containers is first
        seen["stashed"] = torch._C._get_obj_in_tls("tree_manager_containers") is first
        seen["locks"] = torch._C._is_key_in_tls("tree_manager_locks")
        seen["own"] = first is not main

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    assert seen == {"before": False, "kept": True, "stashed": True, "locks": True, "own": True}
