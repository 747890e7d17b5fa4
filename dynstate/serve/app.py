"""The Starlette application of ``dynstate serve``: HTML pages rendered on the server and their
JSON twins under ``/api``, read-only (GET only), over one :class:`~dynstate.serve.api.StoreView`.
Each route is a method of :class:`Site` that asks the view for one document and renders it;
:data:`ROUTES` maps paths to them."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from importlib import resources
from typing import Any
from urllib.parse import quote

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ..errors import (
    CheckpointNotFoundError,
    CorruptStoreError,
    DynstateError,
    InvalidDataError,
    StateMismatchError,
    StoreNotFoundError,
    VersionNotFoundError,
)
from .api import RowNotFoundError, StoreView, chart_failed, scrub
from .chart import growth_svg
from .graph import graph_svg
from .outcome_charts import band_color, band_svg, filtered_svg, pass_rate_svg
from .render import dumps, environment, qs, web_terms
from .rows import OUTCOME_PARAMS, column_filters

log = logging.getLogger("dynstate")

_PACKAGE = resources.files("dynstate.serve")


def _status(exc: DynstateError) -> int:
    missing = (VersionNotFoundError, RowNotFoundError, StoreNotFoundError, CheckpointNotFoundError)
    if isinstance(exc, missing):
        return 404
    if isinstance(exc, InvalidDataError):
        return 400
    if isinstance(exc, StateMismatchError):
        return 409
    if isinstance(exc, CorruptStoreError):
        # A damaged record or file the page needs: the request is fine, the data it names
        # cannot be served as it is (the message names the file; other pages still work).
        return 422
    return 500


def _base(request: Request) -> str:
    return str(request.scope.get("root_path", ""))


Handler = Callable[["Site", Request], Response]


class Site:
    """The pages and JSON documents of one :class:`StoreView`: each route is a method that
    asks the view for one document and renders it (a template, or the document as JSON);
    :meth:`endpoint` turns a method into a Starlette endpoint that answers errors the one
    way every route does. Nothing here computes what the library does not."""

    def __init__(self, view: StoreView, *, warm: bool = True):
        self.view = view
        self.env = environment(str(_PACKAGE / "templates"))
        self.warm = warm
        self._started = threading.Event()

    # -- responses ---------------------------------------------------------------------------

    def body(self, text: str) -> bytes:
        return scrub(text, self.view.secrets).encode()

    def page(
        self, request: Request, template: str, api: str, code: int = 200, **ctx: Any
    ) -> Response:
        base = _base(request)
        html = self.env.get_template(template).render(
            base=base, url=self.view.store.display_url, api=base + api, request=request, **ctx
        )
        return HTMLResponse(self.body(html), status_code=code)

    def json(self, data: Any, status: int = 200) -> Response:
        return Response(self.body(dumps(data)), status, media_type="application/json")

    def error(
        self,
        request: Request,
        status: int,
        message: str,
        headers: Mapping[str, str] | None = None,
    ) -> Response:
        message = scrub(web_terms(message), self.view.secrets)
        if request.url.path.startswith("/api/"):
            response = self.json({"error": message, "status": status}, status)
        else:
            response = self.page(
                request, "error.html", "/api/store", status, status=status, message=message
            )
        response.headers.update(headers or {})
        return response

    def warm_up(self) -> None:
        """Build the growth chart and the head's outcome bands in a background thread, once."""
        if self.warm and not self._started.is_set():
            self._started.set()
            threading.Thread(
                target=_warm, args=(self.view,), daemon=True, name="dynstate-warm"
            ).start()

    def endpoint(self, handler: Handler) -> Callable[[Request], Response]:
        """``handler`` as an endpoint: a :class:`DynstateError` becomes its status and
        message, anything else one line (the traceback only in the server's log)."""

        def respond(request: Request) -> Response:
            try:
                return handler(self, request)
            except DynstateError as exc:
                status = _status(exc)
                if status == 500:
                    log.warning("%s: %s", request.url.path, scrub(str(exc), self.view.secrets))
                return self.error(request, status, str(exc))
            except Exception as exc:
                # A bug or a record no view expected: one line to the browser, the traceback
                # only in the server's log (with -vv), never a page of Python.
                what = type(exc).__name__
                text = " ".join(str(exc).split())[:200]
                what = scrub(what + (f": {text}" if text else ""), self.view.secrets)
                debug = log.isEnabledFor(logging.DEBUG)
                log.warning("%s failed: %s", request.url.path, what, exc_info=debug)
                message = f"this page could not be built ({what}); other pages may still work"
                return self.error(request, 500, message)
            finally:
                self.warm_up()

        return respond

    async def not_found(self, request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 404
        detail = exc.detail if isinstance(exc, HTTPException) else "not found"
        # A 405 names the methods allowed in its Allow header (RFC 9110 §15.5.6).
        headers = exc.headers if isinstance(exc, HTTPException) else None
        if status == 404:
            detail = f"no page at {request.url.path}; the store page is /, the API is /api/store"
        elif status == 405:
            detail = f"{request.method} is not allowed: the web view is read-only (GET only)"
        return self.error(request, status, str(detail), headers)

    # -- documents shared by a page and its twin ---------------------------------------------

    def rows(self, request: Request, version: int | None = None) -> dict[str, Any]:
        """The rows document of the path's version, or of ``version`` (the number a page has
        resolved already: a page shows one version however the head moves meanwhile)."""
        q = request.query_params
        return self.view.rows_page(
            request.path_params["v"] if version is None else version,
            offset=q.get("offset"),
            limit=q.get("limit"),
            q=q.get("q"),
            filters=column_filters(q.multi_items()),
            outcome={k: q.get(k) for k in OUTCOME_PARAMS},
        )

    def outcomes(self, request: Request) -> dict[str, Any]:
        q = request.query_params
        return self.view.outcomes_info(q.get("version"), bins=q.get("bins"), points=q.get("points"))

    # -- JSON --------------------------------------------------------------------------------

    def api_store(self, request: Request) -> Response:
        return self.json(self.view.store_info())

    def api_versions(self, request: Request) -> Response:
        q = request.query_params
        return self.json(self.view.versions_page(limit=q.get("limit"), before=q.get("before")))

    def api_version(self, request: Request) -> Response:
        return self.json(self.view.version_info(request.path_params["v"]))

    def api_rows(self, request: Request) -> Response:
        return self.json(self.rows(request))

    def row(self, request: Request) -> dict[str, Any]:
        p, q = request.path_params, request.query_params
        return self.view.row_detail(
            p["v"], p["i"], limit=q.get("limit"), before=q.get("before"), points=q.get("points")
        )

    def api_row(self, request: Request) -> Response:
        return self.json(self.row(request))

    def api_outcomes(self, request: Request) -> Response:
        return self.json(self.outcomes(request))

    def api_diff(self, request: Request) -> Response:
        return self.json(self.view.diff(request.path_params["a"], request.path_params["b"]))

    def api_checkpoint(self, request: Request) -> Response:
        return self.json(self.view.checkpoint(request.path_params["k"]))

    # -- HTML --------------------------------------------------------------------------------

    def store_page(self, request: Request) -> Response:
        view = self.view
        # One head for the whole page: the summary's, read once (a writer may commit meanwhile).
        info = view.store_info()
        recent = view.versions_page(limit="15", head=info["head"])
        try:
            chart = growth_svg(info["growth"], link=f"{_base(request)}/versions/")
        except (ArithmeticError, ValueError, TypeError, MemoryError) as exc:
            log.warning("growth chart of %s: %s: %s", view.store.display_url,
                        type(exc).__name__, exc)  # fmt: skip
            info = {**info, "growth": chart_failed(info["growth"].get("floor", 0), exc)}
            chart = ""
        return self.page(request, "store.html", "/api/store", info=info, recent=recent, chart=chart)

    def versions_page(self, request: Request) -> Response:
        q = request.query_params
        data = self.view.versions_page(limit=q.get("limit"), before=q.get("before"))
        return self.page(request, "versions.html", "/api/versions" + qs(request), data=data)

    def version_page(self, request: Request) -> Response:
        info = self.view.version_info(request.path_params["v"])
        rows = self.rows(request, info["version"])
        api_path = f"/api/versions/{info['version']}/rows{qs(request)}"
        return self.page(request, "version.html", api_path, info=info, rows=rows)

    def row_page(self, request: Request) -> Response:
        detail = self.row(request)
        graph = graph_svg(detail, link=f"{_base(request)}/versions/{detail['version']}/rows/")
        query = qs(request) if request.query_params else ""
        api_path = f"/api/versions/{detail['version']}/rows/{detail['row']}{query}"
        place = detail["outcome_steps"]
        rate_chart = pass_rate_svg(place["chart"], place["total"]) if place else ""
        return self.page(
            request, "row.html", api_path, detail=detail, graph=graph, rate_chart=rate_chart
        )

    def outcomes_page(self, request: Request) -> Response:
        data = self.outcomes(request)
        bands = data["bands"]
        chart = band_svg(bands) if bands else ""
        drawn = data["drawn_bands"]
        drawn_chart = (
            band_svg(drawn, title="rows drawn per pass-rate band at each step", css="bands drawn")
            if drawn
            else ""
        )
        swatches = [band_color(i, bands["bins"]) for i in range(bands["bins"] if bands else 0)]
        api_path = "/api/outcomes" + qs(request)
        return self.page(
            request,
            "outcomes.html",
            api_path,
            data=data,
            chart=chart,
            drawn_chart=drawn_chart,
            filtered_chart=filtered_svg(data["filtering"]["steps"]) if data["filtering"] else "",
            swatches=swatches,
        )

    def diff_form(self, request: Request) -> Response:
        q = request.query_params
        if q.get("a") and q.get("b"):
            # Each of what was typed is one path segment: its own page answers for it.
            a, b = quote(q["a"], safe=""), quote(q["b"], safe="")
            return RedirectResponse(f"{_base(request)}/diff/{a}/{b}", status_code=303)
        head = self.view.store.refresh()
        return self.page(request, "diff_form.html", "/api/store", head=head)

    def diff_page(self, request: Request) -> Response:
        data = self.view.diff(request.path_params["a"], request.path_params["b"])
        api_path = f"/api/diff/{data['from']}/{data['to']}"
        return self.page(request, "diff.html", api_path, data=data)

    def checkpoint_page(self, request: Request) -> Response:
        data = self.view.checkpoint(request.path_params["k"])
        return self.page(request, "checkpoint.html", f"/api/checkpoints/{data['id']}", data=data)


# Every route: its path and the Site method that answers it.
ROUTES: tuple[tuple[str, Handler], ...] = (
    ("/", Site.store_page),
    ("/versions", Site.versions_page),
    ("/versions/{v}", Site.version_page),
    ("/versions/{v}/rows/{i}", Site.row_page),
    ("/outcomes", Site.outcomes_page),
    ("/diff", Site.diff_form),
    ("/diff/{a}/{b}", Site.diff_page),
    ("/checkpoints/{k}", Site.checkpoint_page),
    ("/api/store", Site.api_store),
    ("/api/versions", Site.api_versions),
    ("/api/versions/{v}", Site.api_version),
    ("/api/versions/{v}/rows", Site.api_rows),
    ("/api/versions/{v}/rows/{i}", Site.api_row),
    ("/api/outcomes", Site.api_outcomes),
    ("/api/diff/{a}/{b}", Site.api_diff),
    ("/api/checkpoints/{k}", Site.api_checkpoint),
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
    site = Site(view, warm=warm)
    routes: list[Route | Mount] = [Route(path, site.endpoint(fn)) for path, fn in ROUTES]
    routes.append(Mount("/static", StaticFiles(directory=str(_PACKAGE / "static")), name="static"))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        timer = threading.Timer(1.0, site.warm_up)
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
        exception_handlers={404: site.not_found, 405: site.not_found},
        lifespan=lifespan,
    )


def _warm(view: StoreView) -> None:
    try:
        view.growth()
    except DynstateError as exc:
        log.warning("could not build the growth chart of %s: %s", view.store.display_url, exc)
    try:
        # The head's /outcomes document (its statistics and bands per step, at the page's
        # defaults): better built here than in the first request for it.
        view.outcomes_info(None)
    except DynstateError as exc:
        log.warning("could not build the outcome bands of %s: %s", view.store.display_url, exc)
