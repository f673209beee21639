"""The web console: ``GET /`` and its static files under ``/console/``
(lmspd/console: plain HTML, JS and CSS shipped in the package; no build
step, nothing fetched from elsewhere — the CSP says so to the browser).

The page itself needs no key: it asks for one when the API answers 401 and
keeps it in the tab's sessionStorage only.
"""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

CONSOLE_DIR = Path(__file__).resolve().parent.parent / "console"
# Only this server: no CDN, no font service, no framing by other sites.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'")
SECURITY_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
                    "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


async def index(request: Request) -> Response:
    return FileResponse(CONSOLE_DIR / "index.html", media_type="text/html", headers=SECURITY_HEADERS)


class _ConsoleFiles(StaticFiles):
    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(SECURITY_HEADERS)
        return response


def routes() -> list[Route | Mount]:
    return [
        Route("/", index, methods=["GET"]),
        Mount("/console", app=_ConsoleFiles(directory=CONSOLE_DIR), name="console"),
    ]
