"""The web console in a real browser (Debian's chromium, driven by
Playwright) against a real server: streamed text, a continued second turn
whose cached_tokens > 0, the cache chart updated, the engine and tasks
views — with every request that is not to the server blocked.

Screenshots of each view are written to the test's tmp folder.
"""

from __future__ import annotations

import re
import shutil

import httpx
import pytest

playwright_api = pytest.importorskip("playwright.sync_api")
expect = playwright_api.expect

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
TIMEOUT_MS = 120_000


@pytest.fixture(scope="module")
def browser():
    if not shutil.which("chromium"):
        pytest.fail("chromium is not installed (./dev.sh installs it)")
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        yield b
        b.close()


def open_console(browser, base_url: str):
    """A fresh page on the console, with every request elsewhere refused."""
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    expect.set_options(timeout=TIMEOUT_MS)
    blocked: list[str] = []
    errors: list[str] = []

    def gate(route):
        if route.request.url.startswith(base_url + "/"):
            route.continue_()
        else:
            blocked.append(route.request.url)
            route.abort()

    context.route("**/*", gate)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(base_url + "/")
    return context, page, blocked, errors


def test_console_streams_continues_and_charts_the_cache(server, browser, tmp_path):
    context, page, blocked, errors = open_console(browser, server.url)
    try:
        page.wait_for_selector("#model option", state="attached")
        assert page.locator("#model").input_value() == "smollm2-135m-instruct"
        page.fill("#instructions", "Answer in one short sentence.")
        page.fill("#max-tokens", "8")  # a shared CI machine: short turns

        # Turn 1: the text arrives in pieces before the turn's usage does.
        page.fill("#message", "Name a colour.")
        page.click("#send")
        expect(page.locator(".turn.assistant .text").first).not_to_be_empty()
        expect(page.locator(".meta.usage")).to_have_count(1)
        first_text = page.locator(".turn.assistant .text").first.text_content()
        assert first_text.strip()

        # Turn 2 continues by previous_response_id: its prompt comes from the cache.
        page.fill("#message", "Name another one.")
        page.click("#send")
        try:
            expect(page.locator(".meta.usage")).to_have_count(2)
        except AssertionError:
            page.screenshot(path=str(tmp_path / "failed.png"), full_page=True)
            raise AssertionError(page.locator("#transcript").text_content()) from None
        cached = int(page.locator(".meta.usage").nth(1).get_attribute("data-cached-tokens"))
        assert cached > 0
        assert page.locator("#turn-chart").get_attribute("data-bars") == "2"
        assert page.locator("#turn-chart rect.bar.reused").count() == 2
        assert "cached " + str(cached) in page.locator(".meta.usage").nth(1).text_content()
        page.screenshot(path=str(tmp_path / "playground.png"), full_page=True)

        # The engine view shows the same turns with their cache source.
        page.click("button.tab[data-tab=engine]")
        expect(page.locator("#engine-chart")).to_have_attribute("data-bars", re.compile(r"^([2-9]|\d\d+)$"))
        row = page.locator("#recent tbody tr").first.text_content()
        assert str(cached) in row
        assert page.locator("#engine-models .card").count() == 1
        assert "RAM tier" in page.locator("#engine-models").text_content()
        page.screenshot(path=str(tmp_path / "engine.png"), full_page=True)

        # Tasks: a background task, its events followed live to the end.
        page.click("button.tab[data-tab=tasks]")
        page.fill("#task-input", "Say hello.")
        page.click("#task-form button[type=submit]")
        # Eight tokens: the task ends complete or at its token cap (incomplete).
        expect(page.locator("#task-events")).to_contain_text(re.compile(r"response\.(completed|incomplete)"))
        expect(page.locator("#task-list tbody")).to_contain_text(re.compile(r"completed|incomplete"))
        page.screenshot(path=str(tmp_path / "tasks.png"), full_page=True)
    finally:
        context.close()
    assert blocked == [], blocked
    assert errors == [], errors
    print("screenshots in", tmp_path)


def test_with_a_key_the_page_asks_and_keeps_it_in_the_tab(keyed_server, browser, tmp_path):
    assert httpx.get(keyed_server.url + "/lmsp/v1/engine", timeout=30).status_code == 401
    assert httpx.get(keyed_server.url + "/").status_code == 200  # the page itself is open
    context, page, blocked, errors = open_console(browser, keyed_server.url)
    try:
        page.wait_for_selector("#key-dialog[open]")
        page.fill("#key-input", "wrong")
        page.click("#key-form button[type=submit]")
        page.wait_for_selector("#key-error:not([hidden])")
        page.fill("#key-input", "alice-key")
        page.click("#key-form button[type=submit]")
        page.wait_for_selector("#model option", state="attached")
        assert page.evaluate("sessionStorage.getItem('lmspd-api-key')") == "alice-key"
        assert page.evaluate("localStorage.length") == 0
        page.screenshot(path=str(tmp_path / "keyed.png"))
    finally:
        context.close()
    assert blocked == [] and errors == []


def test_engine_view_shows_a_long_prefill_live(server, browser, tmp_path):
    """While a ~3,000-token prompt is evaluated, the engine view shows its
    progress (tokens done of the total) and a progress bar; it is gone after."""
    import threading

    from test_prefill_progress import long_prompt

    context, page, blocked, errors = open_console(browser, server.url)
    try:
        page.click("button.tab[data-tab=engine]")
        page.wait_for_selector("#engine-models .card")
        body = {"model": "smollm2-135m-instruct", "input": long_prompt(), "max_output_tokens": 1}
        sender = threading.Thread(target=lambda: httpx.post(server.url + "/v1/responses", json=body, timeout=600))
        sender.start()
        try:
            text = page.locator("#engine-models .prefill-text").first
            expect(text).to_contain_text(re.compile(r"prefilling seq \d+ \([0-9a-f]{6}\): \d+ / \d+ tokens"))
            done, total = map(int, re.search(r"(\d+) / (\d+) tokens", text.text_content()).groups())
            assert 0 <= done <= total and total > 2000
            assert page.locator("#engine-models .prefill progress").count() >= 1
            page.screenshot(path=str(tmp_path / "prefill.png"), full_page=True)
        finally:
            sender.join()
        expect(page.locator("#engine-models .prefill")).to_have_count(0)
    finally:
        context.close()
    assert blocked == [], blocked
    assert errors == [], errors
