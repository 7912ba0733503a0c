"""Who may act: CSRF tokens on every form, and a login with the broker's token.

Every browser gets a random session id in an HttpOnly, SameSite=Strict cookie; each
form carries HMAC(secret, session id) as its CSRF token, so another site can neither
read nor forge it. When an action token is configured (the broker's
``--auth-token-file``, the dashboard's ``--token-file``), a session may act only after it
logged in with that token; logging in gives a fresh session id.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field

from aiohttp import web

COOKIE = "sbd_session"
MAX_SESSIONS = 1000


def _same(offered: str, expected: bytes) -> bool:
    """Constant-time comparison of a form value with a secret, as bytes: compare_digest refuses
    str holding non-ASCII (a 500 and a traceback), and any str encodes with errors replaced."""
    return hmac.compare_digest(offered.encode("utf-8", "replace"), expected)


class Refused(Exception):
    """An action the guard does not allow; the message is shown to the operator."""


@dataclass
class Guard:
    action_token: bytes | None = None
    read_only: bool = False
    read_only_reason: str = "this dashboard is read-only"
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32))
    _authed: OrderedDict[str, None] = field(default_factory=OrderedDict)

    def session(self, request: web.Request) -> str | None:
        sid = request.cookies.get(COOKIE)
        return sid if sid and len(sid) < 100 else None

    def ensure_session(self, request: web.Request, response: web.StreamResponse) -> str:
        """The browser's session id, setting a new cookie when it has none."""
        sid = self.session(request)
        if sid is None:
            sid = secrets.token_urlsafe(24)
            self._set_cookie(response, sid)
        return sid

    def _set_cookie(self, response: web.StreamResponse, sid: str) -> None:
        response.set_cookie(COOKIE, sid, httponly=True, samesite="Strict", path="/")

    def csrf_token(self, sid: str) -> str:
        return hmac.new(self.secret, b"csrf:" + sid.encode(), hashlib.sha256).hexdigest()

    def logged_in(self, sid: str | None) -> bool:
        return self.action_token is None or (sid is not None and sid in self._authed)

    def can_act(self, sid: str | None) -> bool:
        return not self.read_only and self.logged_in(sid)

    def check_post(self, request: web.Request, form: dict[str, str], action: bool = True) -> str:
        """Raise Refused unless this POST carries the session's CSRF token (and, for actions, a login)."""
        origin = request.headers.get("Origin")
        if origin and origin != "null" and origin.split("://", 1)[-1] != request.host:
            raise Refused(f"refused: the request came from another site ({origin})")
        sid = self.session(request)
        offered = form.get("csrf", "")
        if sid is None or not _same(offered, self.csrf_token(sid).encode()):
            raise Refused("refused: missing or wrong CSRF token (reload the page and try again)")
        if action:
            if self.read_only:
                raise Refused(f"refused: {self.read_only_reason}")
            if not self.logged_in(sid):
                raise Refused("refused: actions need the token; log in first")
        return sid

    def login(self, offered: str, response: web.StreamResponse) -> bool:
        if self.action_token is None or not _same(offered.strip(), self.action_token):
            return False
        sid = secrets.token_urlsafe(24)
        self._authed[sid] = None
        while len(self._authed) > MAX_SESSIONS:
            self._authed.popitem(last=False)
        self._set_cookie(response, sid)
        return True

    def logout(self, sid: str | None) -> None:
        if sid is not None:
            self._authed.pop(sid, None)
