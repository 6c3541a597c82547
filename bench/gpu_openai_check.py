"""
One OpenAI-client round trip against the real chat server: start `python -m scripts.chat_web` (a subprocess, as a
user would, loading a checkpoint) on a free local port, then ask it one question with the `openai` package, plain
and streaming, and print the answers, their token counts and times.

    python -m bench.gpu_openai_check -i base        # the base checkpoint base_train wrote
    python -m bench.gpu_openai_check -i sft -g d20 --device_type=cpu
"""

import os
import socket
import subprocess
import sys
import time
import urllib.request


def build_flags():
    from nanochat.checkpoint_manager import checkpoint_flags
    from nanochat.common import device_type_flag
    from nanochat.configurator import Flag, Flags

    return Flags(
        "the served checkpoint (passed on to scripts.chat_web)",
        checkpoint_flags("sft"),
        device_type_flag(),
        "the check",
        Flag("max_tokens", 64, "tokens to generate in each of the two requests"),
        Flag("startup_timeout", 180.0, "seconds to wait for chat_web's /health"),
        description=__doc__,
    )


def main(argv=None):
    from nanochat.configurator import parse_flags_or_exit

    args = parse_flags_or_exit(build_flags(), argv, description=__doc__)
    import openai

    argv = [f"--source={args['source']}"]
    for key in ("model_tag", "step", "device_type"):
        if args[key] not in (None, ""):
            argv.append(f"--{key}={args[key]}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "NANOCHAT_API_KEY": "bench-key"}
    server = subprocess.Popen([sys.executable, "-m", "scripts.chat_web", "--port", str(port), *argv], env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        t0 = time.perf_counter()
        while True:
            if server.poll() is not None:
                raise SystemExit(f"chat_web exited with {server.returncode} before it served")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
            if time.perf_counter() - t0 > args["startup_timeout"]:
                raise SystemExit(f"chat_web did not answer /health within {args['startup_timeout']:.0f} s")
        print(f"chat_web up in {time.perf_counter() - t0:.1f} s", flush=True)
        client = openai.OpenAI(base_url=base + "/v1", api_key="bench-key", max_retries=0)
        question = [{"role": "user", "content": "What is the capital of France?"}]
        t0 = time.perf_counter()
        reply = client.chat.completions.create(model="nanochat", messages=question, max_tokens=args["max_tokens"],
                                               temperature=0.0)
        dt = time.perf_counter() - t0
        text = reply.choices[0].message.content
        print(f"openai round trip (plain): {reply.usage.completion_tokens} tokens in {dt:.2f} s, "
              f"finish_reason={reply.choices[0].finish_reason}: {text[:120]!r}", flush=True)
        t0 = time.perf_counter()
        first, pieces = None, []
        for chunk in client.chat.completions.create(model="nanochat", messages=question, max_tokens=args["max_tokens"],
                                                    temperature=0.0, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter() - t0
                pieces.append(chunk.choices[0].delta.content)
        dt = time.perf_counter() - t0
        same = "".join(pieces) == text
        print(f"openai round trip (stream): {len(pieces)} chunks in {dt:.2f} s, first after {first or 0:.3f} s, "
              f"same text as plain at temperature 0: {same}", flush=True)
        if not same:
            raise SystemExit("streamed text differs from the plain reply at temperature 0")
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
