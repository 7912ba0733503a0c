"""The dashboard's aiohttp application: pages, the JSON feed, actions.

The same application is served by `spark-beanstalk dashboard` (any beanstalkd-protocol
servers) and by our broker on its HTTP listener. Templates autoescape everything, so a
job body of ``<script>`` is shown as text.
"""
from __future__ import annotations

import logging
import secrets
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from importlib import resources
from pathlib import Path
from typing import Any

import jinja2
from aiohttp import web

from spark_beanstalk.aio import AsyncConnection
from spark_beanstalk.client import BeanstalkError
from spark_beanstalk.dashboard import actions
from spark_beanstalk.dashboard.guard import Guard, Refused
from spark_beanstalk.dashboard.sampler import Endpoint, Sampler, ServerView

log = logging.getLogger("spark_beanstalk.dashboard")
PACKAGE_DIR = Path(str(resources.files("spark_beanstalk.dashboard")))
MAX_FLASHES = 200

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class PageError(Exception):
    """Shown to the operator as a page with this message and an HTTP status."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class Dashboard:
    """Routes and the state they share: the sampler, the guard, one-shot result messages."""

    def __init__(self, endpoints: list[Endpoint], guard: Guard, title: str = "spark-beanstalk") -> None:
        self.sampler = Sampler(endpoints)
        self.guard = guard
        self.title = title
        self.flashes: OrderedDict[str, tuple[bool, str]] = OrderedDict()
        self.env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(PACKAGE_DIR / "templates")),
                                      autoescape=True, undefined=jinja2.StrictUndefined)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/", self.overview)
        app.router.add_get("/api/overview", self.api_overview)
        app.router.add_get("/tube", self.tube_page, name="tube")
        app.router.add_post("/action", self.action)
        app.router.add_get("/login", self.login_page)
        app.router.add_post("/login", self.login)
        app.router.add_post("/logout", self.logout)
        app.router.add_static("/static/", PACKAGE_DIR / "static", name="static", append_version=True)
        app.middlewares.append(self.errors)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)

    async def _start(self, _app: web.Application) -> None:
        self.sampler.start()

    async def _stop(self, _app: web.Application) -> None:
        await self.sampler.stop()

    # -- rendering ------------------------------------------------------------------
    def render(self, request: web.Request, template: str, status: int = 200, **context: Any) -> web.Response:
        response = web.Response(status=status, content_type="text/html", charset="utf-8")
        sid = self.guard.ensure_session(request, response)
        page = self.env.get_template(template).render(
            title=self.title, csrf=self.guard.csrf_token(sid), can_act=self.guard.can_act(sid),
            needs_login=not self.guard.logged_in(sid) and not self.guard.read_only,
            logged_in=self.guard.action_token is not None and self.guard.logged_in(sid),
            read_only=self.guard.read_only, read_only_reason=self.guard.read_only_reason,
            static=lambda name: request.app.router["static"].url_for(filename=name),
            **context)
        response.text = page
        return response

    @web.middleware
    async def errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every failure becomes a page with one clear sentence, never a traceback."""
        try:
            return await handler(request)
        except PageError as exc:
            return self.render(request, "message.html", status=exc.status, ok=False, message=str(exc))
        except Refused as exc:
            return self.render(request, "message.html", status=403, ok=False, message=str(exc))
        except BeanstalkError as exc:
            return self.render(request, "message.html", status=502, ok=False,
                               message=f"the server did not answer as expected: {exc}")
        except web.HTTPException as exc:
            if exc.status >= 400 and not request.path.startswith("/static/"):
                return self.render(request, "message.html", status=exc.status, ok=False,
                                   message=f"{exc.status} {exc.reason}")
            raise
        except Exception:
            log.exception("dashboard request %s failed", request.path)
            return self.render(request, "message.html", status=500, ok=False,
                               message="internal error (details are in the dashboard's log)")

    # -- pages ----------------------------------------------------------------------
    async def overview(self, request: web.Request) -> web.StreamResponse:
        self.sampler.viewed()
        views = self.sampler.views
        return self.render(request, "overview.html", servers=[v.summary() for v in views],
                           tubes=[row for v in views for row in v.tube_rows()])

    async def api_overview(self, request: web.Request) -> web.StreamResponse:
        self.sampler.viewed()
        views = self.sampler.views
        body: dict[str, Any] = {"servers": [v.summary() for v in views],
                                "tubes": [row for v in views for row in v.tube_rows()],
                                "time": max((v.last.at for v in views if v.last), default=None)}
        if request.query.get("history"):
            body["history"] = {str(v.index): v.history_json() for v in views}
        return web.json_response(body, headers={"Cache-Control": "no-store"})

    def _view(self, raw: str) -> ServerView:
        # ASCII digits only: int() takes "-1" (a list index from the end: the last server)
        # and other scripts' digits ("٠" is 0).
        try:
            if not (raw.isascii() and raw.isdigit()):
                raise ValueError(raw)
            return self.sampler.views[int(raw)]
        except (ValueError, IndexError):
            raise PageError(f"no server number {raw!r} on this dashboard", 404) from None

    async def tube_page(self, request: web.Request) -> web.StreamResponse:
        view = self._view(request.query.get("s", "0"))
        tube = request.query.get("t", "")
        conn = await self._connect(view)
        try:
            details = await actions.tube_details(conn, tube)
        finally:
            await conn.close()
        if details["stats"] is None:
            raise PageError(f"tube {tube!r} does not exist on {view.endpoint.name} (it has no jobs and "
                            "no clients use or watch it)", 404)
        flash = self.flashes.pop(request.query.get("done", ""), None)
        return self.render(request, "tube.html", server=view.summary(), tube=tube, stats=details["stats"],
                           jobs=details["jobs"], flash=flash)

    async def _connect(self, view: ServerView) -> AsyncConnection:
        try:
            return await view.endpoint.connect()
        except BeanstalkError as exc:
            raise PageError(f"{view.endpoint.name} is unreachable: {exc}", 502) from None

    async def action(self, request: web.Request) -> web.StreamResponse:
        form = {k: v for k, v in (await request.post()).items() if isinstance(v, str)}
        self.guard.check_post(request, form)
        view = self._view(form.get("s", ""))
        tube = form.get("t", "")
        handler = actions.ACTIONS.get(form.get("action", ""))
        if handler is None:
            raise PageError(f"unknown action {form.get('action', '')!r}")
        conn = await self._connect(view)
        try:
            ok, message = True, await handler(conn, tube, form)
        except actions.ActionError as exc:
            ok, message = False, str(exc)
        except BeanstalkError as exc:
            ok, message = False, f"{view.endpoint.name} refused: {exc}"
        finally:
            await conn.close()
        log.info("dashboard action %s on %s/%s: %s", form.get("action"), view.endpoint.name, tube, message)
        if not ok:  # shown at once: the tube page may not exist (unknown tube)
            return self.render(request, "message.html", status=400, ok=False, message=message)
        key = secrets.token_urlsafe(8)
        self.flashes[key] = (ok, message)
        while len(self.flashes) > MAX_FLASHES:
            self.flashes.popitem(last=False)
        location = request.app.router["tube"].url_for().with_query({"s": str(view.index), "t": tube, "done": key})
        raise web.HTTPSeeOther(location)

    async def login_page(self, request: web.Request) -> web.StreamResponse:
        return self.render(request, "login.html", failed=False)

    async def login(self, request: web.Request) -> web.StreamResponse:
        form = {k: v for k, v in (await request.post()).items() if isinstance(v, str)}
        self.guard.check_post(request, form, action=False)
        response = web.HTTPSeeOther("/")
        if not self.guard.login(form.get("token", ""), response):
            return self.render(request, "login.html", status=403, failed=True)
        raise response

    async def logout(self, request: web.Request) -> web.StreamResponse:
        form = {k: v for k, v in (await request.post()).items() if isinstance(v, str)}
        sid = self.guard.check_post(request, form, action=False)
        self.guard.logout(sid)
        raise web.HTTPSeeOther("/")


def create_app(endpoints: list[Endpoint], guard: Guard, title: str = "spark-beanstalk",
               app: web.Application | None = None) -> web.Application:
    """The dashboard as an aiohttp application (or added to ``app``, e.g. the broker's)."""
    app = app if app is not None else web.Application()
    dashboard = Dashboard(endpoints, guard, title)
    dashboard.add_routes(app)
    return app
