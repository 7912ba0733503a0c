"""The web dashboard in a real headless Chromium (Debian's /usr/bin/chromium via Playwright).

Two targets: our broker serving the dashboard on its own HTTP listener (with
--auth-token-file, so actions need a login), and stock beanstalkd 1.12 watched by the
standalone `spark-beanstalk dashboard` (with --token-file). On each: the overview
loads and follows puts without a reload; kick, delete, pause, clear and move from the
page, checked with a protocol client; a hostile HTML body is shown as text; actions
without the token or without the CSRF token are refused. Screenshots go to
$DASHBOARD_SCREENSHOTS (default: the test's tmp dir). One browser for the module.
"""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spark_beanstalk.client import Connection
from tests.helpers import (
    beanstalkd_process,
    broker_process,
    free_port,
    wait_for_port,
    wait_until,
)

playwright_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
TOKEN = "dash-secret"
HOSTILE = b'<script>window.__pwned = 1</script>"><img src=x onerror="window.__pwned = 2">'
TIMEOUT_MS = 10_000

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs Debian's chromium (scripts/test.sh)")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    pw = playwright_api.sync_playwright().start()
    try:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        yield browser
        browser.close()
    finally:
        pw.stop()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    yield page
    context.close()
    assert errors == [], f"JavaScript errors on the page: {errors}"


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    target = Path(os.environ.get("DASHBOARD_SCREENSHOTS", tmp_path))
    target.mkdir(parents=True, exist_ok=True)
    return target


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


def _counts(conn: Connection, tube: str) -> dict[str, int]:
    st = conn.stats_tube(tube) or {}
    return {s: int(st.get(f"current-jobs-{s}", 0)) for s in ("ready", "delayed", "buried")} | {
        "paused": int(st.get("pause", 0))}


def _message(page: Any) -> str:
    return str(page.locator("#message").inner_text())


def _tube(page: Any, base: str, tube: str) -> None:
    page.goto(f"{base}/tube?s=0&t={tube}")
    assert page.locator("#tube-name").inner_text() == tube


def _refused_without_tokens(page: Any, base: str, logged_in: bool) -> None:
    """A POST without the CSRF token is refused; so is one with it but without a login."""
    page.goto(f"{base}/login")
    csrf = page.locator("input[name=csrf]").first.get_attribute("value")
    form = {"s": "0", "t": "web", "action": "put", "body": "sneaky"}
    resp = page.request.post(f"{base}/action", form=form, max_redirects=0)
    assert resp.status == 403 and "CSRF" in resp.text()
    resp = page.request.post(f"{base}/action", form=form | {"csrf": "0" * 64}, max_redirects=0)
    assert resp.status == 403 and "CSRF" in resp.text()
    if not logged_in:
        resp = page.request.post(f"{base}/action", form=form | {"csrf": csrf}, max_redirects=0)
        assert resp.status == 403 and "need the token" in resp.text()


def _login(page: Any, base: str) -> None:
    page.goto(f"{base}/login")
    page.fill("#token", "wrong")
    page.click("#login-button")
    assert "wrong token" in _message(page)
    page.fill("#token", TOKEN)
    page.click("#login-button")
    page.wait_for_url(f"{base}/")
    assert page.locator("#login-link").count() == 0


def _exercise(page: Any, base: str, conn: Connection, shots: Path, name: str) -> None:
    """The whole walk through the dashboard, checking the server after every action."""
    page.goto(base + "/")
    playwright_api.expect(page.locator("#servers tbody tr").first).to_contain_text("up")
    conn.use("web")
    hostile_id = conn.put(HOSTILE, priority=0)
    for i in range(4):
        conn.put(b'{"n": %d}' % i)
    ready = page.locator('#tubes tr[data-tube="web"] td.ready')
    playwright_api.expect(ready).to_have_text("5")  # no reload: the page polls
    conn.put(b"one more")
    playwright_api.expect(ready).to_have_text("6")
    wait_until(lambda: page.locator("#charts .chart").count() > 0, 10, what="charts")
    page.screenshot(path=str(shots / f"{name}-overview.png"), full_page=True)

    _tube(page, base, "web")
    body = page.locator("#next-ready pre.body")
    assert body.inner_text() == HOSTILE.decode()  # shown as text ...
    assert page.locator("#next-ready pre.body img, #next-ready pre.body script").count() == 0
    assert page.evaluate("window.__pwned") is None  # ... and never run
    page.screenshot(path=str(shots / f"{name}-tube.png"), full_page=True)

    page.click('button[data-act="delete-ready"]')
    assert _message(page) == f"deleted job {hostile_id}"
    assert conn.peek(hostile_id) is None

    conn.watch_only(["web"])
    for _ in range(2):
        job = conn.reserve(0)
        assert job is not None and conn.bury(job.id)
    _tube(page, base, "web")
    buried_id = int(page.locator("#next-buried .job-id").inner_text())
    page.click('button[data-act="kick-buried"]')
    assert _message(page) == f"kicked job {buried_id}"
    page.fill("#kick-form input[name=bound]", "5")
    page.click("#kick-form button")
    assert _message(page) == "kicked 1 job(s) in 'web'"
    assert _counts(conn, "web")["buried"] == 0

    page.fill("#pause-form input[name=seconds]", "60")
    page.click("#pause-form button")
    assert _message(page) == "paused 'web' for 60s"
    assert _counts(conn, "web")["paused"] == 60
    page.click("#resume-form button")
    assert _message(page) == "resumed 'web'"
    assert _counts(conn, "web")["paused"] == 0

    page.fill("#move-form input[name=dst]", "elsewhere")
    page.fill("#move-form input[name=count]", "2")
    page.select_option("#move-form select[name=state]", "ready")
    page.click("#move-form button")
    assert _message(page).startswith("moved 2 job(s) from 'web' to 'elsewhere'")
    assert _counts(conn, "elsewhere")["ready"] == 2 and _counts(conn, "web")["ready"] == 3

    page.fill("#put-form textarea[name=body]", "from the page")
    page.click("#put-form button")
    assert _message(page).startswith("put job ")
    assert _counts(conn, "web")["ready"] == 4

    page.select_option("#clear-form select[name=state]", "all")
    page.check("#clear-form input[name=confirm]")
    page.click("#clear-form button")
    assert _message(page) == "cleared 'web': deleted 4 job(s) (ready 4)"
    assert _counts(conn, "web") == {"ready": 0, "delayed": 0, "buried": 0, "paused": 0}

    page.goto(f"{base}/tube?s=0&t=no-such-tube")
    assert "does not exist" in _message(page)
    page.goto(f"{base}/tube?s=7&t=web")
    assert "no server number" in _message(page)


def test_broker_serves_the_dashboard(page: Any, shots: Path, token_file: Path) -> None:
    http_port = free_port()
    proc = broker_process(extra_args=["--http", f"127.0.0.1:{http_port}", "--auth-token-file", str(token_file)])
    with proc:
        wait_for_port("127.0.0.1", http_port, 10, proc.proc)
        base = f"http://127.0.0.1:{http_port}"
        _refused_without_tokens(page, base, logged_in=False)
        _login(page, base)
        _refused_without_tokens(page, base, logged_in=True)
        with Connection(proc.host, proc.port, auth_token=TOKEN) as conn:
            _exercise(page, base, conn, shots, "broker")


def test_standalone_dashboard_on_beanstalkd(page: Any, shots: Path, token_file: Path) -> None:
    http_port = free_port()
    with beanstalkd_process() as server:
        dash = subprocess.Popen(
            [sys.executable, "-m", "spark_beanstalk.cli", "dashboard", "-H", server.address,
             "--listen", f"127.0.0.1:{http_port}", "--token-file", str(token_file)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
        try:
            wait_for_port("127.0.0.1", http_port, 15, dash)
            base = f"http://127.0.0.1:{http_port}"
            _refused_without_tokens(page, base, logged_in=False)
            _login(page, base)
            with Connection(server.host, server.port) as conn:
                _exercise(page, base, conn, shots, "beanstalkd")
            server.stop()  # the server goes away: the page says so, no traceback
            page.goto(base + "/")
            playwright_api.expect(page.locator("#servers tbody tr").first).to_contain_text("unreachable")
            page.goto(f"{base}/tube?s=0&t=web")
            assert "unreachable" in _message(page)
        finally:
            dash.terminate()
            dash.wait(10)
        assert b"Traceback" not in (dash.stderr.read() if dash.stderr else b"")
