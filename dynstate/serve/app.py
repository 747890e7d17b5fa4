"""The Starlette application of ``dynstate serve``: HTML pages rendered on the server and their
JSON twins under ``/api``, read-only (GET only), over one :class:`~dynstate.serve.api.StoreView`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from importlib import resources
from typing import Any
from urllib.parse import urlencode

import jinja2
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from .._version import __version__
from ..cli.render import chat_text
from ..errors import (
    DynstateError,
    InvalidDataError,
    StateMismatchError,
    StoreNotFoundError,
    VersionNotFoundError,
)
from ..outcome_views import outcome_records_count
from .api import RowNotFoundError, StoreView, chart_failed, scrub
from .chart import COLORS, graph_svg, growth_svg
from .lineage import SOURCE_COLUMN
from .outcome_charts import band_color, band_svg, pass_rate_svg
from .rows import OUTCOME_PARAMS, RESERVED

log = logging.getLogger("dynstate")

_PACKAGE = resources.files("dynstate.serve")


def _status(exc: DynstateError) -> int:
    if isinstance(exc, (VersionNotFoundError, RowNotFoundError, StoreNotFoundError)):
        return 404
    if isinstance(exc, InvalidDataError):
        return 400
    if isinstance(exc, StateMismatchError):
        return 409
    return 500


# The library's advice names Python arguments and CLI commands; a page names pages.
_WEB_TERMS = (
    (
        re.compile(r"pass version=None for the latest"),
        "the versions page (/versions) lists them",
    ),
    (
        re.compile(r"`dynstate ls` lists versions and tags"),
        "the versions page (/versions) lists versions, and the store page (/) the tags",
    ),
    (
        re.compile(r"\(dynstate serve URL --checkpoint PATH\)"),
        "(start dynstate serve with --checkpoint PATH to show one)",
    ),
)


def _web_terms(message: str) -> str:
    for pattern, replacement in _WEB_TERMS:
        message = pattern.sub(replacement, message)
    return message


def _dumps(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False, default=str, indent=1)


def _fmt_bytes(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return ""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _fmt_int(n: Any) -> str:
    if n is None:
        return ""
    return f"{n:,}" if isinstance(n, int) and not isinstance(n, bool) else str(n)


def _cell(value: Any, limit: int = 160) -> str:
    """A value in a table cell: text as is, chat messages by their content (as the CLI
    shows them), anything else as JSON; cut at ``limit`` characters."""
    chat = chat_text(value)
    if chat is not None:
        text = chat
    elif isinstance(value, str):
        text = value
    else:
        text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _scalar(value: Any) -> bool:
    return isinstance(value, (str, int, float, bool)) and not (
        isinstance(value, str) and len(value) > 80
    )


def create_app(
    view: StoreView, *, warm: bool = True, allowed_hosts: Sequence[str] | None = None
) -> Starlette:
    """The web application over ``view``.

    ``warm`` builds the growth chart in a background thread once the first request is answered
    (or a second after start-up if none comes): the store page then rarely waits for it, and
    the first page does not compete with it. ``allowed_hosts`` refuses requests whose Host
    header names another host: a web page elsewhere cannot read a store served on loopback by
    pointing a domain name of its own at 127.0.0.1 (DNS rebinding)."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(_PACKAGE / "templates")),
        autoescape=jinja2.select_autoescape(["html"]),
        trim_blocks=True,
        lstrip_blocks=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters.update(bytes=_fmt_bytes, num=_fmt_int, cell=_cell)
    env.globals.update(
        version=__version__, colors=COLORS, scalar=_scalar, source_column=SOURCE_COLUMN
    )

    def body(text: str) -> bytes:
        return scrub(text, view.secrets).encode()

    def page(request: Request, template: str, api: str, code: int = 200, **ctx: Any) -> Response:
        base = request.scope.get("root_path", "")
        html = env.get_template(template).render(
            base=base, url=view.store.display_url, api=base + api, request=request, **ctx
        )
        return HTMLResponse(body(html), status_code=code)

    def api(data: Any, status: int = 200) -> Response:
        return Response(body(_dumps(data)), status, media_type="application/json")

    def error(request: Request, status: int, message: str) -> Response:
        message = scrub(_web_terms(message), view.secrets)
        if request.url.path.startswith("/api/"):
            return api({"error": message, "status": status}, status)
        return page(request, "error.html", "/api/store", status, status=status, message=message)

    started = threading.Event()

    def warm_up() -> None:
        if warm and not started.is_set():
            started.set()
            threading.Thread(target=_warm, args=(view,), daemon=True, name="dynstate-warm").start()

    def guarded(fn: Callable[[Request], Response]) -> Callable[[Request], Response]:
        def endpoint(request: Request) -> Response:
            try:
                return fn(request)
            except DynstateError as exc:
                status = _status(exc)
                if status == 500:
                    log.warning("%s: %s", request.url.path, scrub(str(exc), view.secrets))
                return error(request, status, str(exc))
            except Exception as exc:
                # A bug or a record no view expected: one line to the browser, the traceback
                # only in the server's log (with -vv), never a page of Python.
                what = type(exc).__name__
                text = " ".join(str(exc).split())[:200]
                what = scrub(what + (f": {text}" if text else ""), view.secrets)
                debug = log.isEnabledFor(logging.DEBUG)
                log.warning("%s failed: %s", request.url.path, what, exc_info=debug)
                message = f"this page could not be built ({what}); other pages may still work"
                return error(request, 500, message)
            finally:
                warm_up()

        return endpoint

    def filters_of(request: Request) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for key, value in request.query_params.multi_items():
            if key not in RESERVED:
                out.setdefault(key, []).append(value)
        return out

    def qs(request: Request, **changes: Any) -> str:
        """The current query string with some parameters replaced (None removes one)."""
        items = [(k, v) for k, v in request.query_params.multi_items() if k not in changes]
        for key, value in changes.items():
            if value is None:
                continue
            for v in value if isinstance(value, list) else [value]:
                items.append((key, str(v)))
        return "?" + urlencode(items) if items else "?"

    env.globals["qs"] = qs

    # -- JSON --------------------------------------------------------------------------------

    def api_store(request: Request) -> Response:
        return api(view.store_info())

    def api_versions(request: Request) -> Response:
        q = request.query_params
        return api(view.versions_page(limit=q.get("limit"), before=q.get("before")))

    def api_version(request: Request) -> Response:
        return api(view.version_info(request.path_params["v"]))

    def api_rows(request: Request) -> Response:
        return api(_rows(request))

    def _rows(request: Request) -> dict[str, Any]:
        q = request.query_params
        return view.rows_page(
            request.path_params["v"],
            offset=q.get("offset"),
            limit=q.get("limit"),
            q=q.get("q"),
            filters=filters_of(request),
            outcome={k: q.get(k) for k in OUTCOME_PARAMS},
        )

    def api_row(request: Request) -> Response:
        return api(view.row_detail(request.path_params["v"], request.path_params["i"]))

    def api_outcomes(request: Request) -> Response:
        return api(_outcomes(request))

    def _outcomes(request: Request) -> dict[str, Any]:
        q = request.query_params
        return view.outcomes_info(q.get("version"), bins=q.get("bins"), points=q.get("points"))

    def api_diff(request: Request) -> Response:
        return api(view.diff(request.path_params["a"], request.path_params["b"]))

    def api_checkpoint(request: Request) -> Response:
        return api(view.checkpoint(request.path_params["k"]))

    # -- HTML --------------------------------------------------------------------------------

    def store_page(request: Request) -> Response:
        info = view.store_info()
        recent = view.versions_page(limit="15")
        base = request.scope.get("root_path", "")
        try:
            chart = growth_svg(info["growth"], link=f"{base}/versions/")
        except (ArithmeticError, ValueError, TypeError, MemoryError) as exc:
            log.warning("growth chart of %s: %s: %s", view.store.display_url,
                        type(exc).__name__, exc)  # fmt: skip
            info = {**info, "growth": chart_failed(info["growth"].get("floor", 0), exc)}
            chart = ""
        return page(request, "store.html", "/api/store", info=info, recent=recent, chart=chart)

    def versions_page(request: Request) -> Response:
        q = request.query_params
        data = view.versions_page(limit=q.get("limit"), before=q.get("before"))
        return page(request, "versions.html", "/api/versions" + qs(request), data=data)

    def version_page(request: Request) -> Response:
        v = request.path_params["v"]
        info = view.version_info(v)
        rows = _rows(request)
        api_path = f"/api/versions/{info['version']}/rows{qs(request)}"
        return page(request, "version.html", api_path, info=info, rows=rows)

    def row_page(request: Request) -> Response:
        detail = view.row_detail(request.path_params["v"], request.path_params["i"])
        base = request.scope.get("root_path", "")
        graph = graph_svg(detail, link=f"{base}/versions/{detail['version']}/rows/")
        api_path = f"/api/versions/{detail['version']}/rows/{detail['row']}"
        history = detail["outcomes"]
        rate_chart = pass_rate_svg(history) if history else ""
        return page(
            request, "row.html", api_path, detail=detail, graph=graph, rate_chart=rate_chart
        )

    def outcomes_page(request: Request) -> Response:
        data = _outcomes(request)
        chart = band_svg(data["bands"]) if data["bands"] else ""
        bins = data["bands"]["bins"] if data["bands"] else 0
        swatches = [band_color(i, bins) for i in range(bins)]
        return page(
            request,
            "outcomes.html",
            "/api/outcomes" + qs(request),
            data=data,
            chart=chart,
            swatches=swatches,
        )

    def diff_form(request: Request) -> Response:
        q = request.query_params
        if q.get("a") and q.get("b"):
            base = request.scope.get("root_path", "")
            return RedirectResponse(f"{base}/diff/{q['a']}/{q['b']}", status_code=303)
        head = view.store.refresh()
        return page(request, "diff_form.html", "/api/store", head=head)

    def diff_page(request: Request) -> Response:
        data = view.diff(request.path_params["a"], request.path_params["b"])
        api_path = f"/api/diff/{data['from']}/{data['to']}"
        return page(request, "diff.html", api_path, data=data)

    def checkpoint_page(request: Request) -> Response:
        data = view.checkpoint(request.path_params["k"])
        return page(request, "checkpoint.html", f"/api/checkpoints/{data['id']}", data=data)

    async def not_found(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 404
        detail = exc.detail if isinstance(exc, HTTPException) else "not found"
        if status == 404:
            detail = f"no page at {request.url.path}; the store page is /, the API is /api/store"
        return error(request, status, str(detail))

    routes = [
        Route("/", guarded(store_page)),
        Route("/versions", guarded(versions_page)),
        Route("/versions/{v}", guarded(version_page)),
        Route("/versions/{v}/rows/{i}", guarded(row_page)),
        Route("/outcomes", guarded(outcomes_page)),
        Route("/diff", guarded(diff_form)),
        Route("/diff/{a}/{b}", guarded(diff_page)),
        Route("/checkpoints/{k}", guarded(checkpoint_page)),
        Route("/api/store", guarded(api_store)),
        Route("/api/versions", guarded(api_versions)),
        Route("/api/versions/{v}", guarded(api_version)),
        Route("/api/versions/{v}/rows", guarded(api_rows)),
        Route("/api/versions/{v}/rows/{i}", guarded(api_row)),
        Route("/api/outcomes", guarded(api_outcomes)),
        Route("/api/diff/{a}/{b}", guarded(api_diff)),
        Route("/api/checkpoints/{k}", guarded(api_checkpoint)),
        Mount("/static", StaticFiles(directory=str(_PACKAGE / "static")), name="static"),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        timer = threading.Timer(1.0, warm_up)
        timer.daemon = True
        if warm:
            timer.start()
        yield
        timer.cancel()

    middleware = []
    if allowed_hosts:
        middleware.append(Middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts)))
    return Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={404: not_found, 405: not_found},
        lifespan=lifespan,
    )


def _warm(view: StoreView) -> None:
    try:
        view.growth()
    except DynstateError as exc:
        log.warning("could not build the growth chart of %s: %s", view.store.display_url, exc)
    try:
        # The band series reads every outcome file of the head's lineage once: better here
        # than in the first request for /outcomes.
        head = view.store.refresh()
        if outcome_records_count(view.store, head):
            view.outcomes.band_series(head)
    except DynstateError as exc:
        log.warning("could not build the outcome bands of %s: %s", view.store.display_url, exc)
