"""The console's aiohttp application: routes, the action checks, and rendering.

Every value a template prints passes through :func:`relay.dsn.mask` (the environment's
``finalize``) and Jinja2's autoescape, so neither a password nor a producer's markup can
reach a page as such. Responses carry a Content-Security-Policy that allows the console's
own script and style only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jinja2
import psycopg
from aiohttp import web
from aiohttp.typedefs import Middleware
from markupsafe import Markup, escape
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from relay.console import pages
from relay.console.auth import Guard
from relay.console.chart import line_chart
from relay.console.history import History
from relay.console.hosts import answers_to, host_of
from relay.db.names import OutboxNames
from relay.db.rows import Conn
from relay.dsn import mask
from relay.durations import age_text
from relay.errors import ConfigError, DatabaseUnavailable, first_line, shown
from relay.ids import parse_outbox_id
from relay.ops.render import bytes_text
from relay.summary import StatusSummary, read_summary

log = logging.getLogger("relay.console")

HERE = Path(__file__).parent
COOKIE = "relay_console_session"
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self';"
    " form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class ConsoleConfig:
    names: OutboxNames
    where: str  # the database, as describe_dsn shows it (no password)
    allow_actions: bool
    by: str | None  # who actions are recorded as; None: the token's name
    refresh_s: float = 2.0  # how often the overview's figures are fetched again
    # The Host names it answers to beyond loopback ones (relay.console.hosts); None: any.
    allowed_hosts: frozenset[str] | None = frozenset()
    # In a console of several outboxes ([[outboxes]]): this one's name, and where its pages
    # are (/o/<name>); the index of all of them is at /.
    outbox: str | None = None

    @property
    def base(self) -> str:
        return f"/o/{self.outbox}" if self.outbox else ""


def _finalize(value: object) -> object:
    if value is None:
        return ""
    if isinstance(value, Markup):
        return value
    return mask(str(value))


def _echo(value: object) -> Markup:
    """What a user typed (a filter, a page number), shown back escaped and never through the
    secret mask: masked, the echo told whoever reads the page whether a guess was the DSN's
    password or the action token (`?error=GUESS` came back as *** only for the right one)."""
    return Markup(escape("" if value is None else str(value)))


def _ts(value: datetime | None) -> str:
    return "-" if value is None else value.isoformat(timespec="seconds")


def _n(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def templates() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,
        finalize=_finalize,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(age=age_text, ts=_ts, n=_n, bytes=bytes_text, echo=_echo)
    env.globals["static"] = lambda name: f"/static/{name}"
    return env


class Console:
    """The handlers, over one pool, one history and one guard."""

    def __init__(self, config: ConsoleConfig, pool: AsyncConnectionPool[Any], history: History, guard: Guard) -> None:
        self.config = config
        self.pool = pool
        self.history = history
        self.guard = guard
        self.env = templates()

    # ---- plumbing

    def render(self, request: web.Request, name: str, status: int = 200, **context: Any) -> web.Response:
        sid = request.cookies.get(COOKIE)
        signed_in = self.guard.session_name(sid)
        base = self.config.base
        text = self.env.get_template(name).render(
            config=self.config,
            names=self.config.names,
            base=base,
            static=lambda file: f"{base}/static/{file}",
            # The page's own path within this outbox's pages (for the navigation's marks).
            path=request.path.removeprefix(base) or "/",
            signed_in=signed_in,
            csrf=self.guard.csrf_for(sid) if sid and signed_in else "",
            **context,
        )
        return web.Response(text=text, status=status, content_type="text/html", charset="utf-8")

    async def read(self, body: Callable[[Conn], Awaitable[Any]]) -> Any:
        async with self.pool.connection() as conn:
            return await body(conn)

    # ---- pages

    async def overview(self, request: web.Request) -> web.Response:
        return self.render(request, "overview.html", **await self._overview_context())

    async def overview_fragment(self, request: web.Request) -> web.Response:
        return self.render(request, "overview_live.html", **await self._overview_context())

    async def _overview_context(self) -> dict[str, Any]:
        view = await self.read(lambda c: pages.overview(c, self.config.names))
        samples = self.history.samples()
        return {
            "view": view,
            "s": view.status.summary,
            "depth": line_chart([(x.at, float(x.awaiting)) for x in samples]),
            "age": line_chart([(x.at, x.oldest_waiting_age_s) for x in samples]),
            "window": self.history.window,
        }

    async def dead(self, request: web.Request) -> web.Response:
        flt = pages.dead_filter(request.query)
        page = pages.page_number(request.query)
        view = await self.read(lambda c: pages.dead_groups(c, self.config.names, flt, page))
        return self.render(request, "dead.html", view=view, flt=flt, query=_filters(request.query))

    async def dead_group(self, request: web.Request) -> web.Response:
        key = request.match_info["key"]
        flt = pages.dead_filter(request.query)
        after = pages.after_id(request.query)
        view = await self.read(lambda c: pages.dead_group(c, self.config.names, key, flt, after))
        return self.render(request, "group.html", view=view, flt=flt, query=_filters(request.query))

    async def payload(self, request: web.Request) -> web.StreamResponse:
        """A message's whole payload, streamed in parts (the page shows its first KiB)."""
        outbox_id = parse_outbox_id(request.match_info["id"], "message id")
        async with self.pool.connection() as conn:
            parts = pages.payload_parts(conn, self.config.names, outbox_id)
            first = await anext(parts, None)
            if first is None:
                return self.render(
                    request, "error.html", status=404, title="Not found", text=f"no message #{outbox_id}"
                )
            response = web.StreamResponse(headers={"Content-Type": "application/json; charset=utf-8"})
            await response.prepare(request)
            await response.write(first)
            async for part in parts:
                await response.write(part)
            await response.write_eof()
            return response

    async def message(self, request: web.Request) -> web.Response:
        outbox_id = parse_outbox_id(request.match_info["id"], "message id")
        view = await self.read(lambda c: pages.message(c, self.config.names, outbox_id))
        if view is None:
            return self.render(request, "error.html", status=404, title="Not found", text=f"no message #{outbox_id}")
        return self.render(request, "message.html", view=view, m=view.message)

    async def blocked(self, request: web.Request) -> web.Response:
        view = await self.read(lambda c: pages.blocked(c, self.config.names))
        return self.render(request, "blocked.html", view=view)

    async def aggregate(self, request: web.Request) -> web.Response:
        aggregate_id = request.query.get("id", "")
        if not aggregate_id or len(aggregate_id) > pages.FILTER_MAX or "\x00" in aggregate_id:
            raise ConfigError("invalid aggregate id: give ?id=AGGREGATE_ID (up to 500 characters)")
        view = await self.read(lambda c: pages.aggregate(c, self.config.names, aggregate_id))
        return self.render(request, "aggregate.html", view=view, e=view.explanation)

    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    # ---- actions

    async def preview(self, request: web.Request) -> web.Response:
        form = await self._form(request)
        name, sid = self._who(request, form)
        req = pages.action_request(form)

        async def dry_run(conn: Conn) -> Any:
            ids = await pages.resolve_ids(conn, self.config.names, req)
            return await pages.act(conn, self.config.names, req, ids, by=self._by(name), dry_run=True)

        result = await self.read(dry_run)
        session = sid or request.cookies.get(COOKIE) or ""
        response = self.render(
            request,
            "preview.html",
            req=req,
            result=result,
            by=self._by(name),
            csrf_token=self.guard.csrf_for(session) if session else "",
        )
        return self._with_session(response, sid)

    async def apply(self, request: web.Request) -> web.Response:
        form = await self._form(request)
        name, sid = self._who(request, form)
        req = pages.action_request(form)
        if not req.ids:
            raise ConfigError("invalid request: the confirm step names its ids (preview first)")
        by = self._by(name)
        result = await self.read(lambda c: pages.act(c, self.config.names, req, list(req.ids), by=by, dry_run=False))
        if result.applied:
            log.info("console: %s of %d dead message(s) by %s", req.action, len(result.changed), by)
        status = 200 if result.applied else 409
        return self._with_session(self.render(request, "done.html", status=status, req=req, result=result), sid)

    async def _form(self, request: web.Request) -> dict[str, str]:
        if not self.config.allow_actions:
            raise web.HTTPForbidden(text="actions are off: start the console with --allow-actions and a --token\n")
        data = await request.post()
        return {k: v for k, v in data.items() if isinstance(v, str)}

    def _who(self, request: web.Request, form: dict[str, str]) -> tuple[str, str | None]:
        """Who asks (a token's name) and, when a form's token just signed them in, the new
        session; else HTTP 403, and nothing is read or written."""
        # Host against host only: behind a proxy that terminates TLS the browser's origin is
        # https:// while this server sees http.
        origin = request.headers.get("Origin")
        if origin is not None and urlsplit(origin).netloc != request.host:
            raise web.HTTPForbidden(text="refused: the request came from another site's page\n")
        header = request.headers.get("Authorization", "")
        if header.startswith("Bearer "):
            token = self.guard.check_token(header.removeprefix("Bearer ").strip())
            if token is None:
                raise web.HTTPForbidden(text="refused: that token is not one of the console's\n")
            return token.name, None
        sid = request.cookies.get(COOKIE)
        signed_in = self.guard.session_name(sid)
        if signed_in is not None and sid is not None:
            if not self.guard.csrf_ok(sid, form.get("csrf")):
                raise web.HTTPForbidden(text="refused: the form's check value is missing or stale; reload the page\n")
            return signed_in, None
        token = self.guard.check_token(form.get("token"))
        if token is None:
            raise web.HTTPForbidden(text="refused: an action needs the console's token\n")
        return token.name, self.guard.open_session(token)

    def _by(self, name: str) -> str:
        return self.config.by or name

    def _with_session(self, response: web.Response, sid: str | None) -> web.Response:
        if sid is not None:
            response.set_cookie(
                COOKIE,
                sid,
                httponly=True,
                samesite="Strict",
                path=f"{self.config.base}/",
                max_age=int(self.guard.ttl_s),
            )
        return response


def _filters(query: Any) -> dict[str, str]:
    """The filters of a page's query string (what links and forms carry on), not its paging."""
    return {k: query[k] for k in ("event_type", "aggregate", "error") if query.get(k)}


def make_app(console: Console) -> web.Application:
    # Outermost first: every response, error pages included, gets the headers, and no
    # handler runs for a Host the console does not answer to.
    app = web.Application(middlewares=[_headers, _errors(console), _host_check(console)])
    app.add_routes(
        [
            web.get("/", console.overview),
            web.get("/fragments/overview", console.overview_fragment),
            web.get("/dead", console.dead),
            web.get("/dead/{key:[0-9a-f]{16}}", console.dead_group),
            web.get("/messages/{id}/payload", console.payload),
            web.get("/messages/{id}", console.message),
            web.get("/blocked", console.blocked),
            web.get("/aggregate", console.aggregate),
            web.get("/healthz", console.healthz),
            web.post("/actions/preview", console.preview),
            web.post("/actions/apply", console.apply),
            web.static("/static", HERE / "static", append_version=True),
        ]
    )
    return app


@web.middleware
async def _headers(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        response = await handler(request)
    except web.HTTPException as exc:  # the router's 404 and 405 come as exceptions
        _secure(request, exc.headers)
        raise
    _secure(request, response.headers)
    return response


def _secure(request: web.Request, headers: Any) -> None:
    headers.setdefault("Content-Security-Policy", CSP)
    headers.setdefault("X-Content-Type-Options", "nosniff")
    headers.setdefault("Referrer-Policy", "same-origin")
    headers.setdefault("X-Frame-Options", "DENY")
    if "/static/" not in request.path:  # /static/... or, with several outboxes, /o/<name>/static/...
        headers.setdefault("Cache-Control", "no-store")


def _host_check(console: Console) -> Middleware:
    """Refuse a request whose Host the console does not answer to (DNS rebinding)."""
    allowed = console.config.allowed_hosts

    @web.middleware
    async def host_check(request: web.Request, handler: Handler) -> web.StreamResponse:
        header = request.headers.get("Host", "")
        if not answers_to(header, allowed):
            # Plain text, not the page: the page's header names the database.
            return web.Response(
                status=403,
                text=f"refused: this console does not answer to the name {shown(host_of(header))}"
                " (start it with --allow-host NAME if that is its name)\n",
            )
        return await handler(request)

    return host_check


def _errors(console: Console) -> Middleware:
    """Bad input is a 400 page with its one line; a database away, a 503 that says so; a
    refusal, a 403 page; anything else a 500 that is logged, never a traceback on a page."""

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPForbidden as exc:
            return console.render(request, "error.html", status=403, title="Refused", text=exc.text or "refused")
        except web.HTTPException:
            raise
        except ConfigError as exc:
            return console.render(request, "error.html", status=400, title="Bad request", text=str(exc))
        except (psycopg.OperationalError, DatabaseUnavailable, PoolTimeout) as exc:
            text = f"the database is unavailable: {mask(first_line(exc))}"
            return console.render(request, "error.html", status=503, title="Database unavailable", text=text)
        except psycopg.Error as exc:
            text = f"the database refused the request: {mask(first_line(exc))}"
            return console.render(request, "error.html", status=500, title="Database error", text=text)
        except Exception:
            log.exception("console: %s %s failed", request.method, request.path)
            return console.render(
                request, "error.html", status=500, title="Internal error", text="the console failed; see its log"
            )

    return errors


def make_index(consoles: Sequence[Console]) -> web.Application:
    """The console of several outboxes ([[outboxes]]): an index at ``/`` with each outbox's
    figures and a link to its pages, which ``consoles`` serve under ``/o/<name>/``."""
    first = consoles[0]
    env = templates()

    async def index(request: web.Request) -> web.Response:
        async def one(console: Console) -> tuple[Console, StatusSummary | None, str | None]:
            try:
                summary = await console.read(lambda conn: read_summary(conn, console.config.names))
            except (psycopg.Error, DatabaseUnavailable, PoolTimeout) as exc:
                return console, None, mask(first_line(exc))
            return console, summary, None

        rows = await asyncio.gather(*(one(c) for c in consoles))
        text = env.get_template("outboxes.html").render(rows=rows, static=lambda file: f"/static/{file}")
        return web.Response(text=text, content_type="text/html", charset="utf-8")

    app = web.Application(middlewares=[_headers, _host_check(first)])
    app.add_routes([web.get("/", index), web.static("/static", HERE / "static", append_version=True)])
    for console in consoles:
        app.add_subapp(console.config.base, make_app(console))
    return app
