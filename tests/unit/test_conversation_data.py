"""The chat stages' data plumbing: packing for mid-training, masked batches for SFT, task mixtures with gaps."""

import json
from pathlib import Path

import pytest
import torch

from nanochat.data.conversations import ConversationPacker, collate_sft, sft_batches
from chat_fixtures import tiny_tokenizer

SHARED_DATA = Path(__file__).resolve().parents[1] / "assets" / "data"  # excerpts of ../shared/data (tests/assets/README.md)


def real_conversations(n=12):
    """Real chat data: identity conversations (multi-turn, some with a system message) and GSM8K (tool calls)."""
    path = SHARED_DATA / "sft" / "identity_conversations.jsonl"
    if not path.exists() or not (SHARED_DATA / "gsm8k" / "train.jsonl").exists():
        pytest.skip(f"real chat data not found under {SHARED_DATA}")
    from tasks.gsm8k import GSM8K

    with open(path, encoding="utf-8") as f:
        identity = [{"messages": json.loads(line)} for _, line in zip(range(n // 2), f)]
    gsm = GSM8K(subset="main", split="train", data_dir=str(SHARED_DATA))
    mixed = []
    for a, b in zip(identity, [gsm[i] for i in range(n - n // 2)]):
        mixed += [a, b]
    return mixed


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


# -----------------------------------------------------------------------------
# mid-training packing


def test_packing_keeps_every_token_once_in_order(tok):
    convs = real_conversations(8)
    rendered = [tok.render_conversation(c)[0] for c in convs]
    bos = tok.get_bos_token_id()
    B, T = 2, 40
    packer = ConversationPacker(convs, tok, B, T)
    n_batches = sum(map(len, rendered)) // (B * T) - 1  # stay inside the first epoch
    assert n_batches >= 3
    inputs, targets = zip(*(next(packer) for _ in range(n_batches)))
    assert all(x.shape == (B, T) and x.dtype == torch.long for x in inputs)
    stream = torch.cat([x.reshape(-1) for x in inputs]).tolist()
    shifted = torch.cat([y.reshape(-1) for y in targets]).tolist()

    expected = [t for ids in rendered for t in ids]
    assert stream == expected[: len(stream)]  # every token once, in order, nothing dropped between batches
    assert shifted == expected[1 : len(stream) + 1]  # targets: the next token, across row and batch boundaries
    starts = [sum(map(len, rendered[:i])) for i in range(len(rendered))]
    bos_positions = [i for i, t in enumerate(stream) if t == bos]
    assert bos_positions == [s for s in starts if s < len(stream)]  # a BOS opens each conversation, nowhere else
    assert all((y >= 0).all() for y in targets)  # mid-training trains on every token
    assert packer.epoch == 0 and 0 < packer.progress <= 1  # still in the first pass


def test_packing_splits_conversations_over_ranks_and_wraps(tok):
    convs = real_conversations(6)
    rendered = [tok.render_conversation(c)[0] for c in convs]
    B, T = 1, 32
    for rank in range(2):
        packer = ConversationPacker(convs, tok, B, T, rank=rank, world_size=2)
        mine = [t for ids in rendered[rank::2] for t in ids]
        n = (2 * len(mine)) // T  # about two passes over this rank's share
        stream = torch.cat([next(packer)[0].reshape(-1) for _ in range(n)]).tolist()
        twice = mine + mine
        assert stream == twice[: len(stream)]  # this rank's conversations only, again from the start after a pass
        assert packer.epoch >= 1 and packer.progress >= 1


# -----------------------------------------------------------------------------
# SFT batches


def assistant_token_ids(tok, conversation):
    """What SFT must train on, built from the messages without render_conversation: each assistant message's text
    and python calls (with their delimiters) and its <|assistant_end|>; tool outputs are not the model's."""
    special = tok.encode_special
    out = []
    for m in conversation["messages"]:
        if m["role"] != "assistant":
            continue
        parts = m["content"] if isinstance(m["content"], list) else [{"type": "text", "text": m["content"]}]
        for p in parts:
            if p["type"] == "text":
                out += tok.encode(p["text"])
            elif p["type"] == "python":
                out += [special("<|python_start|>")] + tok.encode(p["text"]) + [special("<|python_end|>")]
        out.append(special("<|assistant_end|>"))
    return out


def test_sft_batch_trains_exactly_the_assistant_tokens(tok):
    convs = real_conversations(6)
    assert any(isinstance(m["content"], list) for c in convs for m in c["messages"])  # tool calls are covered
    assert any(sum(m["role"] == "assistant" for m in c["messages"]) > 1 for c in convs)  # multi-turn too
    pad = tok.encode_special("<|assistant_end|>")
    rows = [tok.render_conversation(c) for c in convs]
    inputs, targets = collate_sft(rows, pad)
    width = max(len(ids) for ids, _ in rows) - 1
    assert inputs.shape == targets.shape == (len(convs), width)
    for i, (conv, (ids, _)) in enumerate(zip(convs, rows)):
        n = len(ids) - 1
        assert inputs[i, :n].tolist() == ids[:-1]
        assert (inputs[i, n:] == pad).all() and (targets[i, n:] == -1).all()  # padding is never a target
        trained = targets[i][targets[i] >= 0].tolist()
        assert trained == assistant_token_ids(tok, conv)
        # each trained target is the real next token at its position
        pos = (targets[i] >= 0).nonzero().flatten().tolist()
        assert all(targets[i, j].item() == ids[j + 1] for j in pos)
    assert any(len(ids) - 1 < width for ids, _ in rows)  # the batch really had padding


def test_sft_batches_stride_over_ranks_and_loop(tok):
    convs = real_conversations(6)
    pad = tok.encode_special("<|assistant_end|>")
    it = sft_batches(convs, tok, B=2, rank=1, world_size=2, max_tokens=10_000)
    batches = [next(it) for _ in range(3)]  # rank 1 owns conversations 1, 3, 5: the 3rd batch starts a new pass
    expected_rows = [[1, 3], [5, 1], [3, 5]]
    for (x, y), idx in zip(batches, expected_rows):
        ex, ey = collate_sft([tok.render_conversation(convs[i], max_tokens=10_000) for i in idx], pad)
        assert torch.equal(x, ex) and torch.equal(y, ey)


def test_sft_rows_truncate_to_max_tokens(tok):
    convs = real_conversations(2)
    assert all(len(tok.render_conversation(c)[0]) > 41 for c in convs)
    x, y = next(sft_batches(convs, tok, B=2, max_tokens=41))
    assert x.shape == (2, 40)


def test_collate_rejects_bad_rows():
    with pytest.raises(ValueError, match="at least one row"):
        collate_sft([], 0)
    with pytest.raises(ValueError, match="mask entries"):
        collate_sft([([1, 2, 3], [0, 1])], 0)


# -----------------------------------------------------------------------------
# mixtures


def test_mixture_leaves_out_missing_tasks_by_name(tmp_path, capsys):
    from nanochat.data.task_data import TaskDataNotFound
    from tasks.suites import build_mixture

    def missing():
        raise TaskDataNotFound("SmolTalk train", [f"local file {tmp_path}/smoltalk/train.jsonl (missing)"])

    convs = real_conversations(4)
    mixture, used = build_mixture([("SmolTalk", missing), ("local", lambda: _ListTask(convs))], "test data")
    assert used == ["local"] and len(mixture) == 4
    out = capsys.readouterr().out
    assert "leaving out SmolTalk" in out and "smoltalk/train.jsonl" in out
    with pytest.raises(FileNotFoundError, match=r"every task was unavailable \(SmolTalk\)"):
        build_mixture([("SmolTalk", missing)], "test data")


def test_rank_agreement_is_a_pass_through_in_one_process():
    """Without torchrun the collective helpers change nothing: same result, same exception (the torchrun case is
    tests/integration/test_chat_eval.py::test_ddp_ranks_agree_on_a_task_one_rank_lacks)."""
    from nanochat.data.conversations import build_on_every_rank
    from nanochat.distributed.dist import raise_on_every_rank
    from nanochat.data.task_data import TaskDataNotFound

    raise_on_every_rank(None, "nothing")
    with pytest.raises(KeyError):
        raise_on_every_rank(KeyError("k"), "something")
    items = [1, 2]
    assert build_on_every_rank("list", lambda: items) is items
    with pytest.raises(ZeroDivisionError):
        build_on_every_rank("broken", lambda: 1 / 0)

    def missing():
        raise TaskDataNotFound("X", ["nowhere"])

    with pytest.raises(TaskDataNotFound, match="could not find the data for X"):
        build_on_every_rank("X", missing)


class _ListTask:
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]
