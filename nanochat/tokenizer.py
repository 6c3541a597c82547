"""
The nanochat tokenizer: byte-level BPE in the GPT-4 style.

Training runs in Rust (the `rustbpe` extension, fast and parallel); inference runs in tiktoken, built from the
merges rustbpe learned, plus nanochat's special tokens placed after the merges. Both give the same ids (tested).

Also here: rendering chat conversations into token ids with a training mask, and the per-token byte counts
used to report loss in bits per byte.
"""

import copy
import os
import pickle
import sys

import tiktoken

from nanochat.atomic import atomic_write, short_error, torch_file_problem
from nanochat.usage import BadValue, Missing

SPECIAL_TOKENS = [
    # every document begins with the Beginning of Sequence token, which also delimits documents
    "<|bos|>",
    # chat rendering (used from mid-training on)
    "<|user_start|>",
    "<|user_end|>",
    "<|assistant_start|>",
    "<|assistant_end|>",
    # the assistant calling the python tool, and the tool's output coming back
    "<|python_start|>",
    "<|python_end|>",
    "<|output_start|>",
    "<|output_end|>",
]

# GPT-4's split pattern, except that numbers are split into groups of at most 2 digits instead of 3: with a
# small vocabulary, fewer tokens are spent on number chunks. Same string as rustbpe.DEFAULT_PATTERN.
SPLIT_PATTERN = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""

TOKENIZER_FILENAME = "tokenizer.pkl"
TOKEN_BYTES_FILENAME = "token_bytes.pt"
_TOKENIZER_FIX = (
    "models trained with the tokenizer need that exact file, so restore it from a copy if you have one; otherwise "
    "train a new one with `python -m scripts.tok_train` (and then the models too)"
)
_TOKEN_BYTES_FIX = (
    "recompute it from tokenizer.pkl (no retraining): "
    "python -c 'from nanochat.tokenizer import rebuild_token_bytes; rebuild_token_bytes()'"
)


class RustBPETokenizer:
    """Trained by rustbpe, run by tiktoken."""

    def __init__(self, enc, bos_token):
        self.enc = enc
        self.bos_token_id = self.encode_special(bos_token)

    @classmethod
    def train_from_iterator(cls, text_iterator, vocab_size):
        """Train on an iterator of str; `vocab_size` counts the 9 special tokens, which get the last ids."""
        import rustbpe

        vocab_size_no_special = vocab_size - len(SPECIAL_TOKENS)
        if vocab_size_no_special < 256:
            raise ValueError(
                f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)} "
                f"(256 byte tokens + {len(SPECIAL_TOKENS)} special tokens), got {vocab_size}"
            )
        tokenizer = rustbpe.Tokenizer()
        tokenizer.train_from_iterator(text_iterator, vocab_size_no_special, pattern=SPLIT_PATTERN)
        return cls.from_rustbpe(tokenizer)

    @classmethod
    def from_rustbpe(cls, tokenizer):
        """Wrap a trained rustbpe.Tokenizer: its merges become tiktoken's mergeable ranks."""
        ranks = tokenizer.get_mergeable_ranks()
        mergeable_ranks = {bytes(token): rank for token, rank in ranks}
        if len(mergeable_ranks) != len(ranks):
            # tiktoken keys tokens by their bytes, so two merges spelling the same bytes cannot be represented
            raise RuntimeError("rustbpe produced two tokens with the same bytes; tiktoken cannot represent that vocabulary")
        offset = len(mergeable_ranks)
        special_tokens = {name: offset + i for i, name in enumerate(SPECIAL_TOKENS)}
        enc = tiktoken.Encoding(
            name="rustbpe",
            pat_str=tokenizer.get_pattern(),
            mergeable_ranks=mergeable_ranks,
            special_tokens=special_tokens,
        )
        return cls(enc, "<|bos|>")

    @classmethod
    def from_directory(cls, tokenizer_dir):
        path = os.path.join(tokenizer_dir, TOKENIZER_FILENAME)
        if not os.path.exists(path):
            raise Missing(
                f"no tokenizer at {path}: train one with `python -m scripts.tok_train` "
                f"(it writes base_dir/tokenizer/{TOKENIZER_FILENAME})"
            )
        try:
            with open(path, "rb") as f:
                enc = pickle.load(f)
        except (PermissionError, IsADirectoryError, MemoryError):
            raise
        except Exception as e:  # EOFError (empty), UnpicklingError (truncated, garbage), an unknown class, ...
            size = os.path.getsize(path)
            why = ("is empty (0 bytes)" if size == 0
                   else f"is truncated or not a pickled tokenizer ({size:,} bytes)"
                   if isinstance(e, (EOFError, pickle.UnpicklingError)) else f"cannot be unpickled ({size:,} bytes)")
            raise BadValue(f"{path} {why} ({short_error(e)}): {_TOKENIZER_FIX}") from e
        if not isinstance(enc, tiktoken.Encoding):
            raise BadValue(f"{path} does not hold a tiktoken.Encoding (got {type(enc).__name__}): {_TOKENIZER_FIX}")
        return cls(enc, "<|bos|>")

    def save(self, tokenizer_dir):
        """Write tokenizer_dir/tokenizer.pkl (a pickled tiktoken.Encoding), atomically."""
        path = os.path.join(tokenizer_dir, TOKENIZER_FILENAME)
        atomic_write(path, lambda f: pickle.dump(self.enc, f))
        print(f"Saved tokenizer encoding to {path}")
        return path

    # ------------------------------------------------------------------------------------------------
    # vocabulary

    def get_vocab_size(self):
        return self.enc.n_vocab

    def get_special_tokens(self):
        return self.enc.special_tokens_set

    def id_to_token(self, id):
        return self.enc.decode([id])

    def encode_special(self, text):
        try:
            return self.enc.encode_single_token(text)
        except KeyError:
            raise ValueError(f"{text!r} is not a special token; the special tokens are {SPECIAL_TOKENS}") from None

    def get_bos_token_id(self):
        return self.bos_token_id

    # ------------------------------------------------------------------------------------------------
    # encode / decode

    def _special_id(self, token):
        if isinstance(token, int):
            return token
        if isinstance(token, str):
            return self.encode_special(token)
        raise TypeError(f"prepend/append must be a token id or a special token string, got {type(token).__name__}")

    def encode(self, text, prepend=None, append=None, num_threads=8):
        """
        Token ids of a str, or a list of lists for a list of str (encoded in parallel threads).
        Special-token strings inside the text are encoded as ordinary text, never as special tokens.
        prepend/append: a token id or a special token string, added to each sequence.
        """
        prepend_id = None if prepend is None else self._special_id(prepend)
        append_id = None if append is None else self._special_id(append)
        if isinstance(text, str):
            ids = self.enc.encode_ordinary(text)
            if prepend_id is not None:
                ids.insert(0, prepend_id)
            if append_id is not None:
                ids.append(append_id)
            return ids
        if isinstance(text, (list, tuple)):
            for i, t in enumerate(text):
                if not isinstance(t, str):
                    raise TypeError(f"encode: item {i} of the list is {type(t).__name__}, expected str")
            rows = self.enc.encode_ordinary_batch(list(text), num_threads=num_threads)
            if prepend_id is not None:
                rows = [[prepend_id] + row for row in rows]
            if append_id is not None:
                for row in rows:
                    row.append(append_id)
            return rows
        raise TypeError(f"encode takes a str or a list of str, got {type(text).__name__}")

    def __call__(self, *args, **kwargs):
        return self.encode(*args, **kwargs)

    def decode(self, ids):
        """Text of the ids; bytes that are not valid UTF-8 (a cut multi-byte char) become U+FFFD."""
        return self.enc.decode(ids)

    # ------------------------------------------------------------------------------------------------
    # chat

    def render_conversation(self, conversation, max_tokens=2048, strict=True):
        """
        Token ids of a chat conversation and a mask of the same length: 1 on the tokens the model learns to
        produce (assistant text, python tool calls with their delimiters, <|assistant_end|>), 0 elsewhere
        (<|bos|>, user turns, <|assistant_start|>, tool outputs, which the tool and not the model produces).
        A leading system message is merged into the first user message. Truncated to max_tokens.
        strict=False (the chat server's requests) lets user and assistant turns come in any order, as OpenAI
        clients send them, and a system message with no user message after it becomes a user turn of its own.
        """
        ids, mask = [], []

        def add(token_ids, m):
            if isinstance(token_ids, int):
                token_ids = [token_ids]
            ids.extend(token_ids)
            mask.extend([m] * len(token_ids))

        messages = _checked_messages(conversation, strict)
        bos = self.get_bos_token_id()
        user_start, user_end = self.encode_special("<|user_start|>"), self.encode_special("<|user_end|>")
        assistant_start = self.encode_special("<|assistant_start|>")
        assistant_end = self.encode_special("<|assistant_end|>")
        python_start, python_end = self.encode_special("<|python_start|>"), self.encode_special("<|python_end|>")
        output_start, output_end = self.encode_special("<|output_start|>"), self.encode_special("<|output_end|>")

        add(bos, 0)
        for i, message in enumerate(messages):
            content = message["content"]
            if message["role"] == "user":
                if not isinstance(content, str):
                    raise TypeError(f"message {i}: user content must be a str, got {type(content).__name__}")
                add(user_start, 0)
                add(self.encode(content), 0)
                add(user_end, 0)
                continue
            add(assistant_start, 0)
            if isinstance(content, str):
                add(self.encode(content), 1)
            elif isinstance(content, list):
                for j, part in enumerate(content):
                    if not isinstance(part, dict) or not isinstance(part.get("text"), str):
                        raise ValueError(f"message {i}, part {j}: expected a dict with a str 'text', got {part!r:.100}")
                    kind, value_ids = part.get("type"), self.encode(part["text"])
                    if kind == "text":
                        add(value_ids, 1)
                    elif kind == "python":
                        add(python_start, 1)
                        add(value_ids, 1)
                        add(python_end, 1)
                    elif kind == "python_output":
                        # produced by the python tool at inference time, not by the model: not trained on
                        add(output_start, 0)
                        add(value_ids, 0)
                        add(output_end, 0)
                    else:
                        raise ValueError(
                            f"message {i}, part {j}: unknown part type {kind!r} (use 'text', 'python' or 'python_output')"
                        )
            else:
                raise TypeError(
                    f"message {i}: assistant content must be a str or a list of parts, got {type(content).__name__}"
                )
            add(assistant_end, 1)

        return ids[:max_tokens], mask[:max_tokens]

    def render_for_completion(self, conversation, strict=True):
        """
        Prompt ids for generating the next assistant reply: the conversation without its last assistant message
        (if it ends with one), then <|assistant_start|>. Not truncated. The one chat-prompt renderer: chat_eval,
        chat_rl, the chat server and (for each user turn) chat_cli all go through here.
        strict=False (the chat server): every message is part of the prompt, in any order (see
        render_conversation), and a trailing assistant message is a finished turn, not a reply to regenerate.
        """
        conversation = copy.deepcopy(conversation)
        messages = conversation.get("messages") if isinstance(conversation, dict) else None
        if strict and messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
            messages.pop()
        if strict and (not messages or messages[-1].get("role") != "user"):
            raise ValueError("render_for_completion: the conversation must end with a user message (or a user "
                             "message followed by the assistant reply to be regenerated)")
        ids, _ = self.render_conversation(conversation, max_tokens=sys.maxsize, strict=strict)
        ids.append(self.encode_special("<|assistant_start|>"))
        return ids

    def visualize_tokenization(self, ids, mask):
        """Debug view: each token's text, green where the mask is 1 and red where it is 0."""
        green, red, reset = "\033[92m", "\033[91m", "\033[0m"
        return "|".join(f"{green if m else red}{self.decode([i])}{reset}" for i, m in zip(ids, mask))


def _checked_messages(conversation, strict=True):
    """The messages with a leading system message merged into the first user message; strict: roles alternate
    user, assistant, ... (else user and assistant in any order, and a lone system message becomes a user turn)."""
    if not isinstance(conversation, dict) or not isinstance(conversation.get("messages"), list):
        raise ValueError('a conversation is a dict {"messages": [{"role": ..., "content": ...}, ...]}')
    messages = conversation["messages"]
    if not messages:
        raise ValueError("the conversation has no messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {m!r:.100}")
    if messages[0]["role"] == "system":
        followed = len(messages) >= 2 and messages[1]["role"] == "user"
        if strict and not followed:
            raise ValueError("a system message must be followed by a user message (it is merged into it)")
        system, user = messages[0]["content"], messages[1]["content"] if followed else None
        if not isinstance(system, str) or not isinstance(user, (str, type(None))):
            raise TypeError("the system message and the first user message must have str content")
        merged = system + "\n\n" + user if followed else system
        messages = [{"role": "user", "content": merged}] + list(messages[2 if followed else 1 :])
    if not strict:
        for i, m in enumerate(messages):
            if m["role"] not in ("user", "assistant"):
                raise ValueError(f"message {i} has role {m['role']!r}: use 'user' or 'assistant' (or 'system' first)")
        return messages
    for i, m in enumerate(messages):
        expected = "user" if i % 2 == 0 else "assistant"
        if m["role"] != expected:
            raise ValueError(
                f"message {i} has role {m['role']!r} where {expected!r} was expected: messages must alternate "
                f"user, assistant, user, ... (an optional system message first)"
            )
    return messages


# ----------------------------------------------------------------------------------------------------
# helpers used across nanochat


def get_tokenizer():
    """The tokenizer trained by scripts.tok_train, from base_dir/tokenizer."""
    from nanochat.common import get_base_dir

    return RustBPETokenizer.from_directory(os.path.join(get_base_dir(), "tokenizer"))


def compute_token_bytes(tokenizer):
    """int32 tensor: how many UTF-8 bytes each token id stands for (0 for special tokens)."""
    import torch

    enc = tokenizer.enc
    special_ids = {enc.encode_single_token(s) for s in tokenizer.get_special_tokens()}
    counts = [0 if i in special_ids else len(enc.decode_single_token_bytes(i)) for i in range(tokenizer.get_vocab_size())]
    return torch.tensor(counts, dtype=torch.int32)


def save_token_bytes(token_bytes, tokenizer_dir):
    """Write tokenizer_dir/token_bytes.pt atomically."""
    import torch

    path = os.path.join(tokenizer_dir, TOKEN_BYTES_FILENAME)
    atomic_write(path, lambda f: torch.save(token_bytes, f))
    return path


def get_token_bytes(device="cpu"):
    """The token_bytes.pt saved by scripts.tok_train, on `device`; checked against tokenizer.pkl beside it."""
    import torch

    from nanochat.common import get_base_dir

    tokenizer_dir = os.path.join(get_base_dir(), "tokenizer")
    path = os.path.join(tokenizer_dir, TOKEN_BYTES_FILENAME)
    have_tokenizer = os.path.exists(os.path.join(tokenizer_dir, TOKENIZER_FILENAME))
    if not os.path.exists(path):
        fix = _TOKEN_BYTES_FIX if have_tokenizer else "train the tokenizer with `python -m scripts.tok_train`"
        raise Missing(f"no token bytes at {path}: {fix}")
    try:
        with open(path, "rb") as f:
            token_bytes = torch.load(f, map_location=device)
    except (PermissionError, IsADirectoryError, MemoryError):
        raise
    except Exception as e:
        why = torch_file_problem(path) or "cannot be read"
        raise BadValue(f"{path} {why} ({short_error(e)}): {_TOKEN_BYTES_FIX}") from e
    if not isinstance(token_bytes, torch.Tensor) or token_bytes.dim() != 1 or token_bytes.is_floating_point():
        what = f"a {tuple(token_bytes.shape)} {token_bytes.dtype} tensor" if isinstance(token_bytes, torch.Tensor) \
            else f"a {type(token_bytes).__name__}"
        raise BadValue(f"{path} holds {what}, not one integer byte count per token id: {_TOKEN_BYTES_FIX}")
    if have_tokenizer:
        vocab_size = RustBPETokenizer.from_directory(tokenizer_dir).get_vocab_size()
        if len(token_bytes) != vocab_size:
            raise BadValue(
                f"{path} has {len(token_bytes):,} entries but the tokenizer beside it has {vocab_size:,} tokens: "
                f"they come from different tokenizers; {_TOKEN_BYTES_FIX}"
            )
    return token_bytes


def rebuild_token_bytes(tokenizer_dir=None):
    """Recompute token_bytes.pt from tokenizer.pkl (the fix for a missing or damaged one); returns its path."""
    from nanochat.common import get_base_dir

    tokenizer_dir = tokenizer_dir or os.path.join(get_base_dir(), "tokenizer")
    path = save_token_bytes(compute_token_bytes(RustBPETokenizer.from_directory(tokenizer_dir)), tokenizer_dir)
    print(f"Saved token_bytes to {path}")
    return path
