"""The dashboard's application without a browser: in-process aiohttp server, real beanstalk servers.

Runs against our broker and beanstalkd 1.12 (`server` fixture): the JSON feed, the
read-only switch, clear messages for bad input, and how job bodies are shown.
"""
from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
from typing import Any

from aiohttp import ClientSession, CookieJar
from aiohttp.test_utils import TestServer
from click.testing import CliRunner

from spark_beanstalk.cli import main
from spark_beanstalk.client import Connection
from spark_beanstalk.dashboard.actions import body_view
from spark_beanstalk.dashboard.app import create_app
from spark_beanstalk.dashboard.command import tcp_endpoint
from spark_beanstalk.dashboard.guard import Guard
from spark_beanstalk.dashboard.sampler import MAX_CHARTED_TUBES, Sampler, ServerView
from tests.helpers import free_port


async def _with_app(server: Any, guard: Guard, walk: Any) -> Any:
    app = create_app([tcp_endpoint(server.host, server.port, None)], guard)
    async with TestServer(app, host="127.0.0.1") as ts, \
            ClientSession(str(ts.make_url("")), cookie_jar=CookieJar(unsafe=True)) as http:
        return await walk(http)


def _csrf(html: str) -> str:
    match = re.search(r'name="csrf-token" content="([0-9a-f]+)"', html)
    assert match, "no CSRF token on the page"
    return match.group(1)


def test_feed_read_only_and_bad_input(server, conn_factory):
    conn = conn_factory(server)
    conn.use("feed")
    conn.put(b"x")

    async def walk(http: ClientSession) -> None:
        for _ in range(100):
            async with http.get("/api/overview?history=1") as resp:
                feed = await resp.json()
            if any(t["name"] == "feed" for t in feed["tubes"]):
                break
            await asyncio.sleep(0.1)
        row = next(t for t in feed["tubes"] if t["name"] == "feed")
        assert row["ready"] == 1 and feed["servers"][0]["up"] is True
        assert "feed" in feed["history"]["0"]
        async with http.get("/tube?s=0&t=feed") as resp:
            page = await resp.text()
            assert resp.status == 200 and "delete job" not in page and "read-only" in page
        form = {"csrf": _csrf(page), "s": "0", "t": "feed", "action": "delete-job", "job": "1"}
        async with http.post("/action", data=form, allow_redirects=False) as resp:
            assert resp.status == 403 and "refused: this dashboard is read-only" in await resp.text()
        async with http.get("/tube?s=0&t=bad%20name") as resp:
            assert resp.status in (404, 502) and "Traceback" not in await resp.text()
        async with http.get("/nowhere") as resp:
            assert resp.status == 404 and "404 Not Found" in await resp.text()

    asyncio.run(_with_app(server, Guard(read_only=True), walk))
    assert conn.stats_tube("feed")["current-jobs-ready"] == 1


def test_actions_report_bad_input_as_a_sentence(server):
    async def walk(http: ClientSession) -> list[str]:
        async with http.get("/") as resp:
            csrf = _csrf(await resp.text())
        said = []
        for extra in ({"action": "kick-job", "job": "999999"}, {"action": "delete-job", "job": "abc"},
                      {"action": "clear", "state": "all"}, {"action": "move", "state": "all", "dst": "x y"},
                      {"action": "pause", "seconds": "5", "t": "never-used"}):
            form = {"csrf": csrf, "s": "0", "t": "default"} | extra
            async with http.post("/action", data=form) as resp:
                text = await resp.text()
            said.append(re.search(r'id="message" class="error">([^<]*)<', text).group(1))
        return said

    said = asyncio.run(_with_app(server, Guard(), walk))
    assert said == ["job 999999 not found, or not buried or delayed", "job must be a whole number, not &#39;abc&#39;",
                    "clear deletes jobs: tick the confirmation box first", "bad tube name &#39;x y&#39;",
                    "tube &#39;never-used&#39; not found"]


def test_body_views():
    assert body_view(b'{"a": [1, 2]}').kind == "json"
    assert json.loads(body_view(b'{"a": [1, 2]}').text) == {"a": [1, 2]}
    assert body_view(b"plain <b>").kind == "text"
    hexed = body_view(b"\xff\x00abc")
    assert hexed.kind == "hex" and "ff 00 61 62 63" in hexed.text
    big = body_view(b"y" * 10_000)
    assert big.truncated and len(big.text) == 4096 and big.size == 10_000


def test_standalone_refuses_open_listener_without_token():
    result = CliRunner().invoke(main, ["dashboard", "--listen", "0.0.0.0:1"])
    assert result.exit_code == 2 and "--token-file" in result.output and "--read-only" in result.output


def test_two_servers_and_a_cross_site_post(server_factory):
    ours, stock = server_factory("ours"), server_factory("beanstalkd")
    app = create_app([tcp_endpoint(p.host, p.port, None) for p in (ours, stock)], Guard())

    async def walk() -> None:
        async with TestServer(app, host="127.0.0.1") as ts, \
                ClientSession(str(ts.make_url("")), cookie_jar=CookieJar(unsafe=True)) as http:
            for _ in range(100):
                async with http.get("/api/overview") as resp:
                    servers = (await resp.json())["servers"]
                if all(s["up"] for s in servers):
                    break
                await asyncio.sleep(0.1)
            assert [s["name"] for s in servers] == [ours.address, stock.address]
            assert all(s["up"] and s["version"] is not None for s in servers)
            async with http.get("/") as resp:
                csrf = _csrf(await resp.text())
            form = {"csrf": csrf, "s": "1", "t": "default", "action": "put", "body": "x"}
            async with http.post("/action", data=form, headers={"Origin": "http://evil.example"}) as resp:
                assert resp.status == 403 and "another site" in await resp.text()
            async with http.post("/action", data=form, allow_redirects=False) as resp:
                assert resp.status == 303  # the same form from our own page goes through

    asyncio.run(walk())
    with Connection(stock.host, stock.port) as conn:
        assert conn.stats_tube("default")["current-jobs-ready"] == 1
    with Connection(ours.host, ours.port) as conn:
        assert conn.stats_tube("default")["current-jobs-ready"] == 0


def test_taken_listen_port_with_a_refusing_server_exits():
    """The sampler must stop even when its cancel lands as a connect is refused."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        listen = f"127.0.0.1:{taken.getsockname()[1]}"
        result = subprocess.run([sys.executable, "-m", "spark_beanstalk.cli", "dashboard", "-H",
                                 f"127.0.0.1:{free_port()}", "--listen", listen],
                                capture_output=True, text=True, timeout=30)
    finally:
        taken.close()
    assert result.returncode == 1 and f"cannot listen on {listen}" in result.stderr


def test_listen_port_out_of_range_is_a_usage_error():
    result = CliRunner().invoke(main, ["dashboard", "--listen", "127.0.0.1:70000"])
    assert result.exit_code == 2 and "out of range" in result.output


def test_non_ascii_csrf_value_is_refused_not_a_server_error(server):
    async def walk(http: ClientSession) -> list[tuple[int, str]]:
        async with http.get("/"):
            pass  # the session cookie
        out = []
        for path in ("/action", "/login", "/logout"):
            form = {"csrf": "caf\u00e9", "s": "0", "t": "default", "action": "put", "body": "x", "token": "t"}
            async with http.post(path, data=form, allow_redirects=False) as resp:
                out.append((resp.status, await resp.text()))
        return out

    for status, text in asyncio.run(_with_app(server, Guard(action_token=b"t"), walk)):
        assert status == 403 and "wrong CSRF token" in text


def test_pause_action_with_a_bad_tube_name_says_bad_format(server):
    async def walk(http: ClientSession) -> tuple[int, str]:
        async with http.get("/") as resp:
            csrf = _csrf(await resp.text())
        form = {"csrf": csrf, "s": "0", "t": "bad!", "action": "pause", "seconds": "5"}
        async with http.post("/action", data=form) as resp:
            return resp.status, await resp.text()

    status, text = asyncio.run(_with_app(server, Guard(), walk))
    assert status == 400 and "BAD_FORMAT" in text and "not found" not in text


def test_a_server_number_that_is_not_plain_digits_is_not_found(server):
    """s=-1 was a list index from the end: it showed (and acted on) the last server."""
    async def walk(http: ClientSession) -> list[tuple[int, str]]:
        out = []
        for number in ("-1", "\u0660", "+0"):
            async with http.get("/tube", params={"s": number, "t": "default"}) as resp:
                out.append((resp.status, await resp.text()))
        return out

    for status, text in asyncio.run(_with_app(server, Guard(), walk)):
        assert status == 404 and "no server number" in text


def test_the_history_keeps_only_the_tubes_a_chart_can_show(server):
    """15 minutes of a point a second, each with every tube: 3,000 tubes held ~100 MB for charts that
    draw 24 of them."""
    with Connection(server.host, server.port) as conn:
        for n in range(60):
            conn.use(f"t{n:03d}")
            conn.put(b"x")
    view = ServerView(0, tcp_endpoint(server.host, server.port, None))

    async def sample() -> None:
        aconn = await view.endpoint.connect()
        try:
            for _ in range(3):
                await Sampler([view.endpoint]).sample_once(view, aconn)
        finally:
            await aconn.close()

    asyncio.run(sample())
    assert len(view.history) == 3
    assert [len(point) for _, point in view.history] == [MAX_CHARTED_TUBES] * 3
    assert list(view.history_json()) == sorted(["default", *(f"t{n:03d}" for n in range(60))])[:MAX_CHARTED_TUBES]
    assert view.last is not None and len(view.last.tubes) == 61  # the tube table still has every tube
