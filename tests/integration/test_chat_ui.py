"""
The chat page in a real headless browser (Debian's chromium driven by Playwright): send a message, watch the reply
stream in, regenerate, and start a new chat, against the real server and a tiny model.
"""

import json
import os
import shutil
import time

import httpx
import pytest
import torch

from chat_fixtures import ServerThread, tiny_model, tiny_tokenizer
from nanochat.engine import Engine
from nanochat.serving.app import create_app
from nanochat.serving.workers import Worker

pytestmark = pytest.mark.slow  # drives a headless browser

MAX_TOKENS = 24


def chromium_path():
    for candidate in (os.environ.get("CHROMIUM_PATH"), shutil.which("chromium"), shutil.which("chromium-browser")):
        if candidate and os.path.exists(candidate):
            return candidate
    return None


@pytest.fixture(scope="module")
def browser():
    path = chromium_path()
    if path is None:
        pytest.skip("no chromium binary (apt-get install chromium, or NANOCHAT_INSTALL_CHROMIUM=1 bash tests/run.sh as root)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is a dev dependency: pip install -e '.[dev]'")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=path, headless=True, args=["--no-sandbox", "--disable-gpu"])
        yield browser
        browser.close()


class PacedModel(torch.nn.Module):
    """The tiny model at a readable pace (20 ms per forward), so tokens reach the browser one by one as with a real
    model instead of in a single network packet."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.config, self.rotary_seq_len = inner.config, inner.rotary_seq_len

    def get_device(self):
        return self.inner.get_device()

    def forward(self, idx, kv_cache=None):
        time.sleep(0.02)
        return self.inner(idx, kv_cache=kv_cache)


@pytest.fixture(scope="module")
def server():
    tok = tiny_tokenizer()
    model = PacedModel(tiny_model(tok.get_vocab_size(), depth=1, sequence_len=256, seed=2))
    app = create_app([Worker(Engine(model, tok))], max_tokens=MAX_TOKENS, temperature=0.8, top_k=50)
    with ServerThread(app) as s:
        yield s


def greedy_reply_via_api(base_url, messages):
    r = httpx.post(base_url + "/chat/completions", json={"messages": messages, "temperature": 0, "top_k": 0}, timeout=60)
    events = [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == {"done": True}
    return "".join(e["token"] for e in events[:-1])


def test_send_message_and_see_streamed_reply(browser, server):
    page = browser.new_page()
    requests = []
    page.on("request", lambda req: requests.append(req))
    page.goto(server.base_url + "/")
    assert page.title() == "nanochat"
    # controls come pre-filled with the server's defaults; greedy decoding makes the reply predictable
    assert page.input_value("#temperature") == "0.8" and page.input_value("#top-k") == "50"
    page.fill("#temperature", "0")
    page.fill("#top-k", "0")

    first = "Tell me about the river"
    expected = greedy_reply_via_api(server.base_url, [{"role": "user", "content": first}])
    assert expected.strip(), "precondition: the tiny model answers this prompt with some text"

    # count how many times the reply bubble's text changes while it streams
    page.evaluate(
        """() => {
            window.__updates = 0;
            new MutationObserver(() => { window.__updates += 1; })
                .observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true});
        }"""
    )
    page.fill("#input", first)
    page.press("#input", "Enter")
    page.wait_for_selector(".message.assistant:not(.streaming)", timeout=30_000)
    bubbles = page.locator(".message.assistant")
    assert bubbles.count() == 1
    assert bubbles.nth(0).text_content() == expected
    assert page.locator(".message.user").nth(0).text_content() == first
    assert page.evaluate("window.__updates") > 5, "the reply appeared at once instead of streaming"
    assert page.input_value("#input") == ""

    # the request carried the controls' values
    posts = [r for r in requests if r.method == "POST"]
    assert len(posts) == 1 and posts[0].url == server.base_url + "/chat/completions"
    assert json.loads(posts[0].post_data) == {"messages": [{"role": "user", "content": first}], "temperature": 0, "top_k": 0}

    # a follow-up sends the whole conversation
    second = "And the castle?"
    page.fill("#input", second)
    page.click("#send")
    page.wait_for_function("document.querySelectorAll('.message.assistant:not(.streaming)').length === 2", timeout=30_000)
    sent = json.loads([r for r in requests if r.method == "POST"][-1].post_data)["messages"]
    assert sent == [{"role": "user", "content": first}, {"role": "assistant", "content": expected}, {"role": "user", "content": second}]

    # regenerate replaces the last reply (greedy: the same text again) with a new request for it
    n_posts = len([r for r in requests if r.method == "POST"])
    second_reply = bubbles.nth(1).text_content()
    with page.expect_response("**/chat/completions"):
        page.click("#regenerate")
    page.wait_for_selector(".message.assistant.streaming", state="detached", timeout=30_000)
    assert len([r for r in requests if r.method == "POST"]) == n_posts + 1
    assert page.locator(".message.assistant").count() == 2
    assert page.locator(".message.assistant").nth(1).text_content() == second_reply
    assert json.loads([r for r in requests if r.method == "POST"][-1].post_data)["messages"] == sent

    # new chat clears everything
    page.click("#clear")
    assert page.locator(".message").count() == 0
    assert page.locator("#regenerate").is_hidden()

    # the page never talked to anything but this server (no CDN)
    assert requests and all(r.url.startswith(server.base_url) or r.url.startswith("data:") for r in requests)
    page.close()


def posted_messages(requests):
    return [json.loads(r.post_data)["messages"] for r in requests if r.method == "POST"]


def test_validation_errors_are_shown_and_the_rejected_message_is_taken_back(browser, server):
    page = browser.new_page()
    requests = []
    page.on("request", lambda req: requests.append(req))
    page.goto(server.base_url + "/")
    too_long = "x" * 8001  # over the server's per-message limit: a 400
    page.fill("#input", too_long)
    page.click("#send")
    page.wait_for_selector("#error:not(:empty)", timeout=30_000)
    assert "the limit is 8000" in page.text_content("#error")
    # the rejected message left the conversation and the page, and its text is back in the input box to edit
    assert page.locator(".message").count() == 0 and page.locator("#hint").count() == 1
    assert page.input_value("#input") == too_long
    assert page.locator("#regenerate").is_hidden()

    # so the next (normal) message is sent on its own and succeeds
    page.fill("#input", "Hello there")
    page.press("#input", "Enter")
    page.wait_for_selector(".message.assistant:not(.streaming)", timeout=30_000)
    assert page.text_content("#error") == ""
    assert page.locator(".message.user").all_text_contents() == ["Hello there"]
    assert page.locator(".message.assistant").count() == 1 and page.locator(".message.assistant.empty").count() == 0
    assert posted_messages(requests)[-1] == [{"role": "user", "content": "Hello there"}]
    reply = page.locator(".message.assistant").nth(0).text_content()

    # a follow-up that is too long is taken back too; the earlier exchange stays and the conversation goes on
    page.fill("#input", too_long)
    page.click("#send")
    page.wait_for_selector("#error:not(:empty)", timeout=30_000)
    assert page.locator(".message.user").all_text_contents() == ["Hello there"]
    assert page.locator(".message.assistant").count() == 1 and page.input_value("#input") == too_long
    page.fill("#input", "And then?")
    page.click("#send")
    page.wait_for_function("document.querySelectorAll('.message.assistant:not(.streaming)').length === 2", timeout=30_000)
    assert page.text_content("#error") == ""
    assert posted_messages(requests)[-1] == [
        {"role": "user", "content": "Hello there"}, {"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"},
    ]
    page.close()


def test_network_error_before_any_token_takes_the_message_back(browser, server):
    page = browser.new_page()
    requests = []
    page.on("request", lambda req: requests.append(req))
    page.goto(server.base_url + "/")
    page.route("**/chat/completions", lambda route: route.abort("connectionrefused"))
    page.fill("#input", "Are you there?")
    page.press("#input", "Enter")
    page.wait_for_selector("#error:not(:empty)", timeout=30_000)
    assert page.text_content("#error").startswith("Error: ")
    assert page.locator(".message").count() == 0 and page.input_value("#input") == "Are you there?"

    # the network is back: sending the restored text works, and it is sent once
    page.unroute("**/chat/completions")
    page.press("#input", "Enter")
    page.wait_for_selector(".message.assistant:not(.streaming)", timeout=30_000)
    assert page.text_content("#error") == "" and page.input_value("#input") == ""
    assert page.locator(".message.user").all_text_contents() == ["Are you there?"]
    assert posted_messages(requests)[-1] == [{"role": "user", "content": "Are you there?"}]
    page.close()


def test_the_page_sends_the_api_key_from_the_link_or_asks_for_it(browser):
    """With --api_key the page itself loads, and its chat requests carry the key: from #key=... in the link (then
    taken out of the address bar), or typed into the prompt the page shows when the server answers 401."""
    tok = tiny_tokenizer()
    model = tiny_model(tok.get_vocab_size(), depth=1, sequence_len=256, seed=2)
    app = create_app([Worker(Engine(model, tok))], api_key="s3cret key", max_tokens=4)
    with ServerThread(app) as s:
        # 1. the key in the link
        page = browser.new_page()
        requests = []
        page.on("request", lambda req: requests.append(req))
        page.goto(s.base_url + "/#key=s3cret%20key")
        assert page.url == s.base_url + "/"  # the key does not stay in the address bar (or the history)
        page.fill("#input", "Hello")
        page.press("#input", "Enter")
        page.wait_for_selector(".message.assistant:not(.streaming)", timeout=30_000)
        assert page.text_content("#error") == ""
        posts = [r for r in requests if r.method == "POST"]
        assert len(posts) == 1 and posts[0].headers["authorization"] == "Bearer s3cret key"
        page.close()

        # 2. no key yet: the server's 401 makes the page ask once, and the answer is kept for this tab
        page = browser.new_page()
        requests = []
        page.on("request", lambda req: requests.append(req))
        prompts = []

        def answer(dialog):
            prompts.append(dialog.message)
            dialog.accept("s3cret key")

        page.on("dialog", answer)
        page.goto(s.base_url + "/")
        for i, text in enumerate(["Hello", "Again"]):
            page.fill("#input", text)
            page.press("#input", "Enter")
            page.wait_for_function(f"document.querySelectorAll('.message.assistant:not(.streaming)').length === {i + 1}", timeout=30_000)
            assert page.text_content("#error") == ""
        assert prompts == ["This nanochat server needs its API key:"]
        auth = [r.headers.get("authorization") for r in requests if r.method == "POST"]
        assert auth == [None, "Bearer s3cret key", "Bearer s3cret key"]
        page.close()

        # 3. a wrong key (or none: the prompt dismissed) is refused, shown, and the message comes back to the input box
        page = browser.new_page()
        page.on("dialog", lambda dialog: dialog.dismiss())
        page.goto(s.base_url + "/#key=wrong")
        page.fill("#input", "Hello")
        page.press("#input", "Enter")
        page.wait_for_selector("#error:not(:empty)", timeout=30_000)
        assert "Incorrect API key provided" in page.text_content("#error")
        assert page.locator(".message").count() == 0 and page.input_value("#input") == "Hello"
        page.close()
