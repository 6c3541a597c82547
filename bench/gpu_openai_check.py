"""
One OpenAI-client round trip against the real chat server: start `python -m scripts.chat_web` (a subprocess, as a
user would, loading a checkpoint) on a free local port, then ask it one question with the `openai` package, plain
and streaming, and print the answers, their token counts and times.

    python -m bench.gpu_openai_check -i base        # the base checkpoint base_train wrote; flags go to chat_web
"""

import os
import socket
import subprocess
import sys
import time
import urllib.request


def main(argv=None):
    import openai

    argv = sys.argv[1:] if argv is None else argv
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
            if time.perf_counter() - t0 > 180:
                raise SystemExit("chat_web did not answer /health within 180 s")
        print(f"chat_web up in {time.perf_counter() - t0:.1f} s", flush=True)
        client = openai.OpenAI(base_url=base + "/v1", api_key="bench-key", max_retries=0)
        question = [{"role": "user", "content": "What is the capital of France?"}]
        t0 = time.perf_counter()
        reply = client.chat.completions.create(model="nanochat", messages=question, max_tokens=64, temperature=0.0)
        dt = time.perf_counter() - t0
        text = reply.choices[0].message.content
        print(f"openai round trip (plain): {reply.usage.completion_tokens} tokens in {dt:.2f} s, "
              f"finish_reason={reply.choices[0].finish_reason}: {text[:120]!r}", flush=True)
        t0 = time.perf_counter()
        first, pieces = None, []
        for chunk in client.chat.completions.create(model="nanochat", messages=question, max_tokens=64,
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
