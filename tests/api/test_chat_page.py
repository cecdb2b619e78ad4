"""The chat page in a real browser: Debian's headless Chromium, driven through its ChromeDriver by Selenium,
against live servers around the real default model.

scripts/install.sh --test installs chromium and chromium-driver. The machine has no network beyond package
registries, so Chromium runs with everything that phones home turned off and a fresh profile.

KVSERVE_UI_SCREENSHOT=docs/chat-page.png makes test_streams_renders_and_keeps_the_conversation write the
README's screenshot.
"""

import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from server.api.app import create_app
from server.api.config import ServerConfig
from server.api.ui import ui_router
from tests.api.conftest import make_engine
from tests.helpers import thinking_models as tm

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",  # root, in a container
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",  # no network here: without these Chromium keeps dialling out
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]
ANSWER_TIMEOUT = 300  # seconds: the real model on a shared 2-core machine (about 1 s on a quiet one)
KEY = "sk-kvserve-page-3f9a61"
DEFAULT_NAME = "smollm2"  # default_server's served model name (conftest)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    assert not missing, (
        f"{missing} missing: `bash scripts/install.sh --test` installs chromium and chromium-driver"
    )
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console, for CSP violations
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    with tempfile.TemporaryDirectory(prefix="kvserve-chromium-") as profile:
        options.add_argument(f"--user-data-dir={profile}")
        driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
        try:
            driver.set_window_size(1100, 800)
            yield driver
        finally:
            driver.quit()


class Page:
    """The chat page in the browser, with waits instead of sleeps."""

    def __init__(self, driver: WebDriver, url: str):
        self.driver, self.url = driver, url

    def open(self, fresh: bool = True, model: str | None = DEFAULT_NAME) -> "Page":
        self.driver.get(self.url + "/")
        if fresh:  # each server has its own origin, but tests share the default server's
            self.driver.execute_script("localStorage.clear()")
            self.driver.get(self.url + "/")
        if model is not None:
            self.wait(lambda: self.text("model").startswith(model), f"the model name {model!r} shown")
        self.console_errors()  # from here on
        return self

    def wait(self, condition: Callable[[], object], what: str, timeout: float = 60):
        try:
            wait = WebDriverWait(
                self.driver, timeout, poll_frequency=0.05, ignored_exceptions=[StaleElementReferenceException]
            )
            return wait.until(lambda _: condition())
        except TimeoutException:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}") from None

    def el(self, id: str):
        return self.driver.find_element(By.ID, id)

    def text(self, id: str) -> str:
        return self.el(id).text

    def js(self, script: str, *args):
        return self.driver.execute_script(script, *args)

    def set_settings(self, **fields) -> None:
        if not self.el("settings").get_attribute("open"):
            self.driver.find_element(By.CSS_SELECTOR, "#settings summary").click()
        for id, value in fields.items():
            field = self.el(id.replace("_", "-"))
            field.clear()
            field.send_keys(str(value))

    def send(self, text: str) -> None:
        box = self.el("message")
        box.send_keys(text)
        box.send_keys(Keys.ENTER)

    def idle(self) -> bool:
        return self.el("send").is_enabled() and not self.el("stop").is_enabled()

    def wait_idle(self, what: str = "the answer to finish") -> None:
        self.wait(self.idle, what, ANSWER_TIMEOUT)

    def wait_answers(self, count: int) -> None:
        """Until the open conversation holds `count` answers and none is streaming (the page adds the answer
        and turns busy in one go, so this never sees the moment before an answer starts)."""
        selector = "#messages .message.assistant"
        self.wait(
            lambda: len(self.driver.find_elements(By.CSS_SELECTOR, selector)) == count and self.idle(),
            f"answer {count} to finish",
            ANSWER_TIMEOUT,
        )

    # Read in one script, atomically: the page re-renders its messages when an answer ends.
    def messages(self) -> list[tuple[str, str]]:
        found = self.js("""return [...document.querySelectorAll('#messages .message')]
                            .map(m => [m.classList[1], m.querySelector('.content').innerText.trim()])""")
        return [tuple(m) for m in found]

    def last_meta(self) -> str:
        return self.js("""const metas = document.querySelectorAll('#messages .message.assistant .meta');
                          return metas.length ? metas[metas.length - 1].innerText : ''""")

    def error(self) -> str:
        element = self.el("error")
        return element.text if element.is_displayed() else ""

    def console_errors(self) -> list[str]:
        """Errors in the console since the last call: a refused inline style or script, a bad HTML sink."""
        return [e["message"] for e in self.driver.get_log("browser") if e["level"] == "SEVERE"]

    def stored(self) -> list[dict]:
        return json.loads(self.js("return localStorage.getItem('kvserve.conversations')") or "[]")

    def record_answer_states(self) -> None:
        """Record every distinct text of the last answer as the page changes it, in the page itself (a poll
        from here would miss pieces)."""
        self.js("""
            window.answerStates = [];
            new MutationObserver(() => {
              const all = document.querySelectorAll('#messages .assistant .content');
              const text = all.length ? all[all.length - 1].textContent : '';
              if (text && window.answerStates.at(-1) !== text) window.answerStates.push(text);
            }).observe(document.getElementById('messages'),
                       {subtree: true, childList: true, characterData: true});
        """)


def test_streams_renders_and_keeps_the_conversation(browser, default_server):
    page = Page(browser, default_server).open()
    prompt = "Write a Python function that reverses a string."
    page.set_settings(temperature=0, max_tokens=160)
    page.record_answer_states()
    page.send(prompt)
    page.wait_answers(1)
    assert page.error() == ""

    # It streamed: the answer grew through many distinct partial states before the last one.
    states = page.js("return window.answerStates")
    final = states[-1]
    partial = [s for s in states[:-1] if len(s) < len(final)]
    assert len(partial) >= 5, states
    assert len(partial[0]) < len(final) / 4, states  # the first piece came long before the last
    # (Markdown may re-render earlier text as more arrives, e.g. an opening ``` becomes a code block.)

    # Exactly what the API says for the same request, and rendered as Markdown: the code is a code block.
    stored = page.stored()
    assert len(stored) == 1 and [m["role"] for m in stored[0]["messages"]] == ["user", "assistant"]
    answer = stored[0]["messages"][1]
    expected = httpx.post(
        f"{default_server}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": prompt}], "max_tokens": 160, "temperature": 0},
        timeout=ANSWER_TIMEOUT,
    ).json()["choices"][0]["message"]["content"]
    assert answer["content"] == expected
    assert "```" in expected
    code = browser.find_elements(By.CSS_SELECTOR, "#messages .assistant .content pre code")
    assert code and "def " in code[0].text and "```" not in page.messages()[-1][1]

    # Time to first token and speed, per answer.
    meta = page.last_meta()
    assert "first token" in meta and "tokens/s" in meta and f"{answer['stats']['tokens']} tokens" in meta
    assert answer["stats"]["exact"] and answer["stats"]["tokens"] > 5

    # A reload finds the conversation in the list and open, as it was.
    before = page.messages()
    browser.refresh()
    page.wait(lambda: page.text("model").startswith(DEFAULT_NAME), "the page to load again")
    items = browser.find_elements(By.CSS_SELECTOR, "#conversations button.open")
    assert [i.text for i in items] == [prompt]
    assert items[0].get_attribute("aria-current") == "true"
    assert page.messages() == before
    assert page.last_meta() == meta

    assert page.console_errors() == []

    if path := os.environ.get("KVSERVE_UI_SCREENSHOT"):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        browser.find_element(By.CSS_SELECTOR, "#settings summary").click()  # the settings in the picture too
        browser.find_element(By.TAG_NAME, "h1").click()  # and no focus ring
        browser.set_window_size(1200, 980)
        assert browser.save_screenshot(path)
        browser.set_window_size(1100, 800)

    # New chat, then delete the first one.
    page.el("new-chat").click()
    assert page.messages() == []
    page.set_settings(max_tokens=16)
    page.send("Hi")
    page.wait_answers(1)
    assert len(browser.find_elements(By.CSS_SELECTOR, "#conversations li")) == 2
    older = browser.find_elements(By.CSS_SELECTOR, "#conversations .delete")[1]  # the list is newest first
    older.click()
    browser.switch_to.alert.accept()
    page.wait(lambda: [c["title"] for c in page.stored()] == ["Hi"], "the first chat to be deleted")


def test_a_thinking_models_reasoning_is_shown_apart_and_never_sent_back(browser, start_server, tmp_path):
    """A thinking model (tests/helpers/thinking_models.py: reasoning "Sum: 4", answer "OK"): the page shows the
    reasoning folded above the answer, open while it streams, kept with the conversation, and sends only the
    answer back on the next turn (the history the server renders holds no reasoning)."""
    url, _ = start_server(make_engine(tm.think_model(tmp_path / "think")), served_model_name="think")
    page = Page(browser, url).open(model="think")
    page.set_settings(temperature=0, max_tokens=32)
    page.js("""
        window.reasoningOpen = [];
        new MutationObserver(() => {
          const r = document.querySelector('#messages .assistant .reasoning');
          if (r && !r.hidden) window.reasoningOpen.push(r.open);
        }).observe(document.getElementById('messages'),
                   {subtree: true, childList: true, characterData: true, attributes: true});
    """)
    page.send("What is 2 + 2?")
    page.wait_answers(1)
    assert page.error() == "" and page.messages()[-1] == ("assistant", tm.THINK_ANSWER)
    reasoning = browser.find_element(By.CSS_SELECTOR, "#messages .assistant .reasoning")
    assert reasoning.get_attribute("open") is None  # folded once the answer came
    assert True in page.js("return window.reasoningOpen")  # open while the model was thinking
    reasoning.find_element(By.TAG_NAME, "summary").click()
    assert reasoning.find_element(By.CSS_SELECTOR, ".thinking").text.strip() == tm.THINK_REASONING
    answer = page.stored()[0]["messages"][1]
    assert (answer["content"], answer["reasoning"].strip()) == (tm.THINK_ANSWER, tm.THINK_REASONING)
    assert "tokens" in page.last_meta()  # the reasoning's tokens counted in the answer's

    # kept: after a reload, folded above the answer
    browser.refresh()
    page.wait(lambda: page.messages() and page.messages()[-1][1] == tm.THINK_ANSWER, "the stored answer")
    reasoning = browser.find_element(By.CSS_SELECTOR, "#messages .assistant .reasoning")
    assert reasoning.get_attribute("open") is None and reasoning.is_displayed()
    # a user's message has none, nor an answer without reasoning
    assert not browser.find_elements(By.CSS_SELECTOR, "#messages .user .reasoning")

    # the next turn's request carries the answer alone (the bodies the page sends, seen on their way)
    page.js("""
        const original = window.fetch;
        window.sentBodies = [];
        window.fetch = (url, init) => { if (init?.body) window.sentBodies.push(init.body); return original(url, init); };
    """)
    page.send("And 3 + 3?")
    page.wait_answers(2)
    history = json.loads(page.js("return window.sentBodies.at(-1)"))["messages"]
    assert history[1] == {"role": "assistant", "content": tm.THINK_ANSWER}
    assert page.console_errors() == []


def test_stop_aborts_the_request_and_frees_its_cache(browser, default_server, scrape, wait_for):
    page = Page(browser, default_server).open()
    page.set_settings(temperature=0, max_tokens=1000)
    before = scrape(default_server).get("kvserve:request_success_total{abort}", 0)
    page.send("Write a long essay about the history of Rome.")
    page.wait(lambda: len(page.messages()[-1][1]) >= 20, "the answer to start", ANSWER_TIMEOUT)
    running = scrape(default_server)
    assert running["kvserve:num_requests_running"] == 1 and running["kvserve:kv_cache_usage_perc"] > 0
    page.el("stop").click()
    page.wait_idle("the page to stop")
    assert page.last_meta().startswith("stopped")
    assert page.error() == ""

    # The server saw the client go: the request ended as an abort and its KV blocks are free.
    # (The API counts the abort at once; the engine drops the request at its next step.)
    def freed() -> bool:
        now = scrape(default_server)
        aborted = now.get("kvserve:request_success_total{abort}", 0) == before + 1
        return (
            aborted and now["kvserve:num_requests_running"] == 0 and now["kvserve:kv_cache_usage_perc"] == 0
        )

    wait_for(freed, 60, "the abort in /metrics and the KV cache free")
    # The partial answer stays, marked as stopped.
    stored = page.stored()[0]["messages"][-1]
    assert stored["finish"] == "stopped" and stored["content"] and stored["content"] in page.messages()[-1][1]
    assert stored["stats"]["tokens"] < 1000 and not stored["stats"]["exact"]  # counted by the page, not told


def test_asks_for_the_api_key_and_says_when_it_is_wrong(browser, default_engine, start_server):
    url, _ = start_server(default_engine, api_key=KEY, served_model_name=DEFAULT_NAME)
    page = Page(browser, url).open(model=None)
    dialog = page.el("key-dialog")
    page.wait(dialog.is_displayed, "the API key dialog")
    assert "needs an API key" in page.text("key-reason")
    assert page.js("return document.activeElement.id") == "api-key"

    page.el("api-key").send_keys("not-the-key", Keys.ENTER)
    page.wait(lambda: "refused" in page.text("key-reason"), "the wrong key to be refused")
    assert "401" in page.text("key-reason") and dialog.is_displayed()

    page.el("api-key").send_keys(KEY, Keys.ENTER)
    page.wait(lambda: page.text("model").startswith(DEFAULT_NAME), "the models list with the right key")
    assert not dialog.is_displayed()
    assert json.loads(page.js("return localStorage.getItem('kvserve.apiKey')")) == KEY
    page.set_settings(max_tokens=8)
    page.send("Hi")
    page.wait_answers(1)
    assert page.error() == "" and page.messages()[-1][0] == "assistant" and page.messages()[-1][1]

    # The key changes under the page: its next request is refused, in words, and nothing is lost.
    page.js("localStorage.setItem('kvserve.apiKey', JSON.stringify('stale'))")
    page.send("And again")
    page.wait(dialog.is_displayed, "the API key dialog after a 401")
    assert "401" in page.text("key-reason") and "401" in page.error()
    assert page.el("message").get_attribute("value") == "And again"  # kept, to send again
    assert len(page.stored()[0]["messages"]) == 2


def test_errors_are_shown_in_words(browser, default_server, default_engine, start_server, serve_app):
    # 400: the server's own message, naming the field
    page = Page(browser, default_server).open()
    page.set_settings(temperature=-1)
    page.send("Hello there")
    page.wait(page.error, "the 400 to be shown")
    assert "400" in page.error() and "temperature" in page.error()
    assert page.messages() == [] and page.el("message").get_attribute("value") == "Hello there"

    # 429: a server whose queue is full
    busy, _ = start_server(default_engine, max_queue=0, served_model_name=DEFAULT_NAME)
    page = Page(browser, busy).open()
    page.send("Hello")
    page.wait(page.error, "the 429 to be shown")
    assert "busy" in page.error() and "429" in page.error() and "Try again in 1 s" in page.error()

    # the server gone
    with serve_app(create_app(default_engine, ServerConfig(served_model_name=DEFAULT_NAME))) as gone:
        page = Page(browser, gone).open()
    page.send("Anyone there?")
    page.wait(page.error, "the lost server to be shown")
    assert "Cannot reach the server" in page.error()
    assert page.el("message").get_attribute("value") == "Anyone there?"


def test_phone_width_and_keyboard_only(browser, default_server):
    page = Page(browser, default_server).open()
    browser.set_window_size(390, 844)
    try:
        width = page.js("return window.innerWidth")
        assert page.js("return document.documentElement.scrollWidth") <= width, "sideways scrolling"
        for id in ("message", "send", "toggle-chats"):
            rect = page.js(f"return document.getElementById('{id}').getBoundingClientRect().toJSON()")
            assert (
                0 <= rect["left"]
                and rect["right"] <= width
                and rect["bottom"] <= page.js("return window.innerHeight")
            ), id
        assert not page.el("chats").is_displayed()  # the conversation list is behind the Chats button

        # Every control has a name a screen reader can read.
        unnamed = page.js("""
            return [...document.querySelectorAll('input, textarea, button, summary')].filter(el =>
              !(el.labels && el.labels.length) && !el.getAttribute('aria-label') && !el.textContent.trim()
            ).map(el => el.outerHTML);
        """)
        assert unnamed == []

        # Keyboard alone: Tab from the top reaches the Chats button, the settings and the message box, with the
        # focus always visible; Shift+Enter is a new line, Enter sends.
        page.set_settings(temperature=0, max_tokens=8)
        page.js("document.querySelector('.skip').focus()")
        order = ["skip"]
        for _ in range(30):
            ActionChains(browser).send_keys(Keys.TAB).perform()
            focused = page.js("return document.activeElement.id || document.activeElement.tagName")
            outline = page.js("return getComputedStyle(document.activeElement).outlineStyle")
            assert outline != "none", f"no visible focus on {focused} after {order}"
            order.append(focused)
            if focused == "message":
                break
        assert order[-1] == "message", order
        assert order.index("toggle-chats") < order.index("temperature") < order.index("message"), order

        actions = ActionChains(browser).send_keys("first line")
        actions.key_down(Keys.SHIFT).send_keys(Keys.ENTER).key_up(Keys.SHIFT).send_keys("second line")
        actions.perform()
        assert page.el("message").get_attribute("value") == "first line\nsecond line"
        ActionChains(browser).send_keys(Keys.ENTER).perform()
        page.wait_answers(1)
        assert page.messages()[0] == ("user", "first line\nsecond line")
        assert page.messages()[-1][0] == "assistant" and page.messages()[-1][1]
        assert page.js("return document.activeElement.id") == "message"  # ready for the next one

        # The Chats button opens the list, by keyboard.
        page.el("toggle-chats").send_keys(Keys.ENTER)
        page.wait(page.el("chats").is_displayed, "the conversation list")
        assert page.el("toggle-chats").get_attribute("aria-expanded") == "true"
    finally:
        browser.set_window_size(1100, 800)


HOSTILE = [
    "Here: <script>window.pwned = 'script'</script> and ",
    "<img src=x onerror=\"window.pwned = 'img'\"> and <ifr",
    'ame srcdoc="<script>parent.pwned = 1</script>"></iframe> ',
    "[click](javascript:window.pwned=1) ![x](http://192.0.2.1/x.png)\n\n",
    "**bold** and\n\n```html\n<script>alert(1)</script>\n```\n\n",
    "| left | centre |\n|---|:-:|\n| <b>1</b> | 2 |\n",
]


def hostile_api() -> FastAPI:
    """The page's router beside an API that streams HTML and script as a model's answer, in pieces that
    split the tags: the real model cannot be made to say this on demand."""
    app = FastAPI()
    app.include_router(ui_router)

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": "hostile", "object": "model", "max_model_len": 2048}]}

    @app.post("/v1/chat/completions")
    def chat():
        def events():
            for piece in HOSTILE:
                yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': piece}}]})}\n\n"
                time.sleep(0.05)
            done = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
            usage = {
                "choices": [],
                "usage": {"prompt_tokens": 3, "completion_tokens": 30, "total_tokens": 33},
            }
            yield f"data: {json.dumps(done)}\n\ndata: {json.dumps(usage)}\n\ndata: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_html_and_script_in_an_answer_show_as_text(browser, serve_app):
    with serve_app(hostile_api()) as url:
        page = Page(browser, url).open(model="hostile")
        page.send("Say something nasty")
        page.wait(lambda: "tokens" in page.last_meta() and page.idle(), "the answer")
        text = page.messages()[-1][1]
        assert "<script>window.pwned = 'script'</script>" in text
        assert "<img src=x onerror=\"window.pwned = 'img'\">" in text
        assert "<iframe srcdoc=" in text
        answer = browser.find_elements(By.CSS_SELECTOR, "#messages .assistant .content")[-1]
        assert answer.find_elements(By.CSS_SELECTOR, "script, img, iframe, b") == []
        # the javascript: link stays text; the image is a plain link, never fetched, opened apart from the page
        links = answer.find_elements(By.TAG_NAME, "a")
        assert [a.get_attribute("href") for a in links] == ["http://192.0.2.1/x.png"]
        assert links[0].get_attribute("rel") == "noopener noreferrer nofollow"
        assert "[click](javascript:window.pwned=1)" in text
        assert answer.find_element(By.TAG_NAME, "strong").text == "bold"
        assert "<script>alert(1)</script>" in answer.find_element(By.CSS_SELECTOR, "pre code").text
        assert page.js("return window.pwned === undefined")
        # a table's alignment is a class: the CSP refuses inline style attributes (and would say so below)
        cell = answer.find_elements(By.CSS_SELECTOR, "td")[1]
        assert cell.get_attribute("class") == "align-center" and cell.get_dom_attribute("style") is None
        assert cell.value_of_css_property("text-align") == "center"
        assert page.console_errors() == []
        # after a reload, from storage, the same
        browser.refresh()
        page.wait(lambda: page.messages() and page.messages()[-1][1] == text, "the stored answer")
        assert page.js("return window.pwned === undefined")
        assert (
            browser.find_elements(By.CSS_SELECTOR, "#messages script, #messages img, #messages iframe") == []
        )

        # Storage is input too: malformed entries are dropped, a title is text.
        title = "<img src=x onerror=\"window.pwned = 'title'\">"
        stored = [
            {"id": 1},
            None,
            {"id": "x", "title": title, "messages": [{"role": "assistant", "content": "**ok**"}]},
        ]
        page.js("localStorage.setItem('kvserve.conversations', arguments[0])", json.dumps(stored))
        page.js("localStorage.setItem('kvserve.current', JSON.stringify('x'))")
        browser.refresh()
        page.wait(lambda: page.messages() == [("assistant", "ok")], "the stored conversation")
        assert [b.text for b in browser.find_elements(By.CSS_SELECTOR, "#conversations button.open")] == [
            title
        ]
        assert browser.find_elements(By.CSS_SELECTOR, "#conversations img") == []
        assert page.js("return window.pwned === undefined")
        assert page.console_errors() == []
