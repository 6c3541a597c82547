"""
What the chat server accepts: the request bodies of its two chat endpoints (nanochat's UI and OpenAI's Chat
Completions), their limits, and the JSON body reader. Every problem becomes a RequestError (400 unless said) whose
message says what to change; a client-supplied name or value goes into a message only through shown() or
quoted(), so the error response can always be encoded.
"""

import json

# Request limits: generous for chat, small enough that one request cannot hog a worker or the host's memory.
MAX_MESSAGES = 500
MAX_MESSAGE_CHARS = 8000
MAX_TOTAL_CHARS = 32000
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.0, 2.0
MIN_TOP_K, MAX_TOP_K = 0, 200  # 0 = no top-k
MIN_MAX_TOKENS, MAX_MAX_TOKENS = 1, 4096
MAX_N = 8  # completions per /v1 request (rows sampled together on one worker)
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts (signed or unsigned 64-bit)
MAX_BODY_BYTES = 1_000_000
# The sampler compares top_p in float32, where 1e-300 is 0 and every token would be dropped (NaN probabilities). Any
# top_p up to the most likely token's probability keeps that token alone, and that probability is >= 1/vocab > 1e-6:
# a smaller top_p is the same request as this one.
MIN_TOP_P = 1e-6


class RequestError(Exception):
    def __init__(self, message, param=None, status=400, code=None, headers=None):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.headers = message, param, status, code, headers


def shown(name):
    """A client-supplied string as it can go into an error message: lone surrogates (valid in JSON's \\ud800 escapes,
    not encodable as UTF-8) become backslash escapes, so building the error response cannot fail."""
    return name.encode("utf-8", "backslashreplace").decode("utf-8")


def quoted(value, limit=80):
    """A client-supplied JSON value for an error message: as JSON (ASCII, so any string encodes), cut at `limit`."""
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _number(body, key, lo, hi, default):
    value = body.get(key)
    if value is None:
        return default
    if not _is_number(value):
        raise RequestError(f"{key} must be a number between {lo} and {hi}, got {quoted(value)}", key)
    if not lo <= value <= hi:
        raise RequestError(f"{key} must be between {lo} and {hi}, got {value}", key)
    return float(value)


def _integer(body, key, lo, hi, default):
    value = body.get(key)
    if value is None:
        return default
    if not _is_int(value):
        raise RequestError(f"{key} must be an integer between {lo} and {hi}, got {quoted(value)}", key)
    if not lo <= value <= hi:
        raise RequestError(f"{key} must be between {lo} and {hi}, got {value}", key)
    return value


def _message_text(content, i):
    """Message content as a string; the OpenAI list-of-parts form is accepted when every part is text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(f"messages[{i}].content: only text parts are supported, got a {quoted(kind)} part", "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(f"messages[{i}].content must be a string, got {type(content).__name__}", "messages")


def validate_messages(messages, allow_system):
    """Checks the message list and returns it as [{"role", "content": str}]."""
    if not isinstance(messages, list):
        raise RequestError("messages must be a list of {role, content} objects", "messages")
    if not 1 <= len(messages) <= MAX_MESSAGES:
        raise RequestError(f"messages must hold between 1 and {MAX_MESSAGES} messages, got {len(messages)}", "messages")
    roles = ("system", "developer", "user", "assistant") if allow_system else ("user", "assistant")
    out, total = [], 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}] must be an object with role and content", "messages")
        role = m.get("role")
        if role not in roles:
            raise RequestError(f"messages[{i}].role must be one of {', '.join(roles)}, got {quoted(role)}", "messages")
        role = "system" if role == "developer" else role  # OpenAI's newer name for the system role
        if role == "system" and i != 0:
            raise RequestError(f"messages[{i}]: a system message is only supported as the first message", "messages")
        if "content" not in m or m["content"] is None:
            raise RequestError(f"messages[{i}] has no content", "messages")
        text = _message_text(m["content"], i)
        if not text.strip():
            raise RequestError(f"messages[{i}].content must not be empty", "messages")
        if shown(text) != text:  # the tokenizer takes UTF-8; a lone surrogate (e.g. "\\ud800") has no encoding
            raise RequestError(f"messages[{i}].content holds a lone UTF-16 surrogate; send valid Unicode text", "messages")
        if len(text) > MAX_MESSAGE_CHARS:
            raise RequestError(f"messages[{i}].content is {len(text)} characters; the limit is {MAX_MESSAGE_CHARS}", "messages")
        total += len(text)
        if total > MAX_TOTAL_CHARS:
            raise RequestError(f"the conversation is over {MAX_TOTAL_CHARS} characters in total; start a new one", "messages")
        out.append({"role": role, "content": text})
    return out


def validate_ui_request(body, defaults):
    """Body of POST /chat/completions."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    unknown = set(body) - {"messages", "temperature", "top_k", "max_tokens"}
    if unknown:
        raise RequestError(f"unknown field(s): {', '.join(shown(k) for k in sorted(unknown))}; allowed: messages, temperature, top_k, max_tokens")
    if "messages" not in body:
        raise RequestError("messages is required", "messages")
    return {
        "messages": validate_messages(body["messages"], allow_system=False),
        "temperature": _number(body, "temperature", MIN_TEMPERATURE, MAX_TEMPERATURE, defaults["temperature"]),
        "top_k": _integer(body, "top_k", MIN_TOP_K, MAX_TOP_K, defaults["top_k"]),
        "max_tokens": _integer(body, "max_tokens", MIN_MAX_TOKENS, MAX_MAX_TOKENS, defaults["max_tokens"]),
        "top_p": None,
        "n": 1,
        "seed": None,
    }


# OpenAI parameters we do not implement: refused when they would change the result, accepted at their no-op value.
_UNSUPPORTED_OPENAI = {
    "stop": lambda v: v is None or v == [] or v == "",
    "tools": lambda v: v is None or v == [],
    "tool_choice": lambda v: v is None or v == "none",
    "functions": lambda v: v is None or v == [],
    "function_call": lambda v: v is None or v == "none",
    "logprobs": lambda v: v is None or v is False,
    "top_logprobs": lambda v: v is None or v == 0,
    "presence_penalty": lambda v: v is None or v == 0,
    "frequency_penalty": lambda v: v is None or v == 0,
    "logit_bias": lambda v: v is None or v == {},
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
    "audio": lambda v: v is None,
    "modalities": lambda v: v is None or v == ["text"],
    "prediction": lambda v: v is None,
}


def validate_openai_request(body, defaults, model_name):
    """Body of POST /v1/chat/completions. Unknown fields are ignored, as OpenAI-compatible servers commonly do."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    for key, is_noop in _UNSUPPORTED_OPENAI.items():
        if key in body and not is_noop(body[key]):
            raise RequestError(f"{key} is not supported by this server", key, code="unsupported_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError(f"model is required (a string); this server serves {json.dumps(model_name)}", "model")
    if model != model_name:
        raise RequestError(
            f"The model {quoted(model)} does not exist; this server serves {json.dumps(model_name)} (see GET /v1/models)",
            "model", status=404, code="model_not_found",
        )
    if "messages" not in body:
        raise RequestError("messages is required", "messages")
    messages = validate_messages(body["messages"], allow_system=True)
    max_tokens = _integer(body, "max_tokens", MIN_MAX_TOKENS, MAX_MAX_TOKENS, None)
    max_completion = _integer(body, "max_completion_tokens", MIN_MAX_TOKENS, MAX_MAX_TOKENS, None)
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise RequestError("max_tokens and max_completion_tokens disagree; send one of them", "max_tokens")
    max_tokens = max_completion if max_completion is not None else max_tokens
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RequestError(f"stream must be true or false, got {quoted(stream)}", "stream")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise RequestError("stream_options must be an object", "stream_options")
    include_usage = stream_options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise RequestError("stream_options.include_usage must be true or false", "stream_options")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise RequestError(f"seed must be an integer, got {quoted(seed)}", "seed")
    if seed is not None and not MIN_SEED <= seed <= MAX_SEED:
        # torch.Generator.manual_seed takes any signed or unsigned 64-bit integer and raises outside that range
        raise RequestError(f"seed must be between {MIN_SEED} and {MAX_SEED}, got {seed}", "seed")
    top_p = _number(body, "top_p", 0.0, 1.0, None)
    if top_p is not None and top_p == 0.0:
        raise RequestError("top_p must be greater than 0 (use temperature 0 for greedy decoding)", "top_p")
    if top_p is not None:
        top_p = max(top_p, MIN_TOP_P)
    return {
        "messages": messages,
        "temperature": _number(body, "temperature", MIN_TEMPERATURE, MAX_TEMPERATURE, defaults["temperature"]),
        # top_k is not an OpenAI parameter; accepted as an extension (as vLLM does)
        "top_k": _integer(body, "top_k", MIN_TOP_K, MAX_TOP_K, defaults["top_k"]),
        "top_p": top_p,
        "max_tokens": max_tokens if max_tokens is not None else defaults["max_tokens"],
        "n": _integer(body, "n", 1, MAX_N, 1),
        "seed": seed,
        "stream": stream,
        "include_usage": include_usage,
    }


async def read_json_body(request):
    """The body as JSON, refusing other content types, oversized or non-JSON bodies with a clear 4xx (never a crash)."""
    # Only application/json (or a +json type): a browser page on another site may POST text/plain, form or
    # untyped bodies without asking first (no CORS preflight), so those are never read as a request.
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/json" and not (content_type.startswith("application/") and content_type.endswith("+json")):
        got = f"got {shown(content_type)!r}" if content_type else "got none"
        raise RequestError(f"send the body as JSON with `Content-Type: application/json` ({got})", status=415, code="unsupported_media_type")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise RequestError(f"request body is larger than {MAX_BODY_BYTES} bytes", status=413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise RequestError(f"request body is larger than {MAX_BODY_BYTES} bytes", status=413)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise RequestError("the request body is empty; send a JSON object")
    try:
        return json.loads(raw)
    except RecursionError:  # e.g. '[' * 50000: nested deeper than the parser can follow
        raise RequestError("the request body is nested too deeply to parse; send a flatter JSON object") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer with too many digits, ...
        raise RequestError(f"the request body is not valid JSON: {e}") from None
