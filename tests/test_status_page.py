"""The status page (GET /, app/static/) in a real headless Chromium (Debian's chromium and chromium-driver, driven by
selenium): it loads with no console error and no request off the host, shows the model, readiness, the self-check's
and the autotune's tables, a record being prefilled and how far along; its form returns the probabilities the API
returns for the same request, a 401 without the key is shown as such, and the key typed in is kept in the page's
memory alone (no web storage, cookie, IndexedDB or URL holds it after a decision). The page's headers and
--no-status-page are checked in-process.

CLEF_STATUS_SCREENSHOT=path writes the page's screenshot there once it shows an answer (docs/status-page.png is one)."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi.testclient import TestClient
from live import ClefServe, PausingEngine, live_server, wait_until

from app.server import ServerSettings, create_app
from clef_cuda import Decider
from clef_cuda.model.default_model import default_release
from clef_cuda.serving.engine import EngineConfig

KEY = "status-page-key"


def chromium_paths() -> tuple[str, str]:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver") or (
        "/usr/bin/chromedriver" if Path("/usr/bin/chromedriver").exists() else None
    )
    if browser is None or driver is None:
        raise RuntimeError("chromium and chromium-driver are not installed (Debian: apt-get install chromium "
                           "chromium-driver; make test's set-up does)")  # fmt: skip
    return browser, driver


@pytest.fixture(scope="module")
def served():
    server = ClefServe(
        "--d", "cpu", "--api-key", KEY, "--autotune", "fast", "--autotune-cache", "", "--shadow-rate", "1"
    )  # fmt: skip
    try:
        server.assert_ready(300)
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver_path = chromium_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1280,1600",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    os.environ.setdefault("SE_AVOID_STATS", "true")  # selenium's own telemetry: nothing leaves this machine
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def requested_urls(driver) -> list[str]:
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


def text(driver, element_id: str) -> str:
    return driver.find_element("id", element_id).text


def answers_on_page(driver) -> dict[str, dict[str, float]]:
    found: dict[str, dict[str, float]] = {}
    for question in driver.find_elements("css selector", "#answers .question"):
        options = question.find_elements("css selector", ".option")
        found[question.get_attribute("data-question")] = {
            o.get_attribute("data-option"): float(o.get_attribute("data-p")) for o in options
        }
    return found


def answers_of(result: dict) -> dict[str, dict[str, float]]:
    found = {}
    for question, answer in result["answers"].items():
        if answer["type"] == "noul":
            found[question] = {"true": answer["noul"], "false": 1 - answer["noul"]}
        else:
            found[question] = dict(answer["probabilities"])
    return found


def test_the_page_loads_from_this_host_alone_and_shows_the_server(served, browser):
    browser.get(served.url + "/")
    wait_until(lambda: text(browser, "readiness") == "ready", "the page to show the server ready", timeout=60)
    wait_until(lambda: browser.find_elements("css selector", "#selfcheck-table tbody tr"), "the self-check's table")
    assert "passed" in text(browser, "selfcheck-summary")
    assert browser.find_elements("css selector", "#autotune-table tbody tr"), "the autotune's choices"
    assert "clef-tiny" in text(browser, "served-model") and "cpu" in text(browser, "model-facts")
    assert "re-decided" in text(browser, "shadow-facts")
    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert not errors, errors
    host = urlsplit(served.url).netloc
    urls = requested_urls(browser)
    assert {"/", "/static/status.js", "/static/status.css", "/status"} <= {urlsplit(u).path for u in urls}
    assert all(urlsplit(u).netloc == host for u in urls if not u.startswith("data:")), urls


def test_the_page_shows_a_record_being_prefilled_and_how_far_along(browser):
    """A record held mid-prefill (PausingEngine) is a row of "Deciding now": its request id, tokens prefilled (with
    the share) of its total; gone from the page once answered."""
    decider = Decider.from_release(default_release(), device="cpu", progress=False)
    engine = PausingEngine(decider, EngineConfig(kv_fraction=0.02, prefill_chunk_size=32))
    request = {"model": "clef-tiny", "state": "word " * 200, "questions": {"q": {"type": "noul"}}}
    with live_server(engine, ServerSettings(served_model_name="clef-tiny")) as (url, _):
        engine.pausing.set()
        post = threading.Thread(
            target=lambda: httpx.post(
                url + "/v1/systemone", json=request, headers={"X-Request-Id": "page-1"}, timeout=120
            )
        )
        post.start()
        try:
            assert engine.paused.wait(60), "the record never started"
            browser.get(url + "/")
            rows = lambda: browser.find_elements("css selector", '#progress-table tbody tr[data-request="page-1"]')  # noqa: E731
            wait_until(rows, "the page to show the record mid-prefill", timeout=30)
            (total,) = [p["tokens_total"] for p in engine.prefills()]
            cells = [cell.text for cell in rows()[0].find_elements("css selector", "td")]
            assert cells[:3] == ["page-1", f"32 ({100 * 32 / total:.0f}%)", f"{total:,}"], cells
            assert text(browser, "progress-summary") == "1 running"
        finally:
            engine.pausing.clear()
            engine.resume.set()
            post.join(120)
        wait_until(lambda: not rows(), "the answered record to leave the page", timeout=30)
        assert text(browser, "progress-summary") == "nothing running"
        browser.get("about:blank")  # this server goes: its page's refreshes must not reach the next test's log
        browser.get_log("browser")  # (reading the log empties it)


def test_the_form_shows_the_apis_probabilities_and_a_401_without_the_key(served, browser):
    browser.get(served.url + "/")
    wait_until(lambda: text(browser, "readiness") == "ready", "the page to load", timeout=60)
    browser.find_element("id", "decide").click()  # no key typed
    wait_until(lambda: text(browser, "decision-error"), "the refusal to show")
    assert text(browser, "decision-error").startswith("401 authentication_error:")
    assert not answers_on_page(browser)

    browser.find_element("id", "api-key").send_keys(KEY)
    browser.find_element("id", "decide").click()
    wait_until(lambda: answers_on_page(browser), "the answers to show")
    shown = answers_on_page(browser)
    state = browser.find_element("id", "state").get_property("value")
    questions = json.loads(browser.find_element("id", "questions").get_property("value"))
    body = {"model": "clef-tiny", "state": state, "questions": questions}
    api = httpx.post(served.url + "/v1/systemone", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert api.status_code == 200
    expected = answers_of(api.json())
    assert shown.keys() == expected.keys() == {"last_error", "last_failure", "last_level"}
    for question, options in expected.items():
        assert shown[question].keys() == options.keys()
        for option, p in options.items():
            assert shown[question][option] == pytest.approx(p, abs=1e-12), (question, option)
    assert not browser.find_element("id", "decision-error").is_displayed()
    assert_the_key_is_kept_nowhere(browser)
    screenshot = os.environ.get("CLEF_STATUS_SCREENSHOT")
    if screenshot:  # the whole page with its tables and an answer, as docs/status-page.png shows it
        browser.set_window_size(1280, browser.execute_script("return document.documentElement.scrollHeight") + 120)
        browser.execute_script("window.scrollTo(0, 0)")
        browser.save_screenshot(screenshot)
    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert [e for e in errors if "401" not in e["message"]] == []  # the refused fetch is the only one logged


def assert_the_key_is_kept_nowhere(driver) -> None:
    """The key typed into the page lives in its field alone (app/static/status.js): after a decision made with it,
    no web storage, cookie, IndexedDB database or URL holds it."""
    stored = driver.execute_script(
        "const all = s => Object.fromEntries("
        "  Array.from({length: s.length}, (_, i) => [s.key(i), s.getItem(s.key(i))]));"
        "return {local: all(localStorage), session: all(sessionStorage), cookie: document.cookie};"
    )
    assert stored == {"local": {}, "session": {}, "cookie": ""}, stored
    assert driver.get_cookies() == []
    databases = driver.execute_async_script("indexedDB.databases().then(arguments[0], () => arguments[0](null))")
    assert databases == [], databases
    assert KEY not in driver.current_url


def test_the_page_is_served_with_a_strict_policy_and_can_be_turned_off():
    with TestClient(create_app(ServerSettings())) as client:
        page = client.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        policy = page.headers["content-security-policy"]
        assert "default-src 'none'" in policy and "script-src 'self'" in policy and "connect-src 'self'" in policy
        assert "unsafe-inline" not in policy and "http" not in policy
        for asset in ("status.js", "status.css"):
            assert client.get(f"/static/{asset}").status_code == 200
        assert client.get("/static/..%2Fserver.py").status_code == 404
        assert client.get("/static/status.html").status_code == 404  # only the listed assets
        status = client.get("/status").json()
        assert status["status"] == "loading" and status["recent"]["requests"] == 0
        html = page.text
        assert "<script>" not in html and "style=" not in html and "http" not in html.replace("http-equiv", "")
    with TestClient(create_app(ServerSettings(status_page=False))) as client:
        assert client.get("/").status_code == 404 and client.get("/static/status.js").status_code == 404
        assert client.get("/status").status_code == 200
