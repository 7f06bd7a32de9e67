"""Serve the status page: ``GET /`` and its static files (no build step, nothing fetched from elsewhere).

The files are read once, when the app is made, and answered from memory: an answer costs one turn
of the event loop, where a file answer read its file in a worker thread, hopping back to the busy
event loop for each step (in a whole-job storm that put seconds between the page's HTML and its
scripts). Each answer has an ETag; a browser revalidating (``Cache-Control: no-cache``) gets a 304.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.responses import Response

__all__ = ["STATIC_DIR", "mount_status_page"]

STATIC_DIR = pathlib.Path(__file__).with_name("static")

_MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                ".css": "text/css; charset=utf-8"}

# The page only talks to this collector; a strict policy keeps any injected markup inert.
_PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; "
                                            "script-src 'self'; connect-src 'self'; base-uri 'none'; "
                                            "frame-ancestors 'none'",
                 "Cache-Control": "no-cache"}


@dataclasses.dataclass(frozen=True)
class _File:
    body: bytes
    media_type: str
    etag: str

    @classmethod
    def read(cls, path: pathlib.Path) -> "_File":
        body = path.read_bytes()
        return cls(body, _MEDIA_TYPES.get(path.suffix, "application/octet-stream"),
                   '"' + hashlib.sha256(body).hexdigest()[:20] + '"')

    def answer(self, request: Request, headers: dict[str, str]) -> Response:
        """The file, or 304 when the browser already holds this version."""
        headers = {**headers, "ETag": self.etag}
        if self.etag in request.headers.get("if-none-match", ""):
            return Response(status_code=304, headers=headers)
        return Response(self.body, media_type=self.media_type, headers=headers)


def mount_status_page(app: FastAPI) -> None:
    """Add ``/`` and ``/static/<file>`` to the collector app (the files read now, into memory)."""
    page = _File.read(STATIC_DIR / "index.html")
    files = {path.name: _File.read(path) for path in STATIC_DIR.iterdir() if path.is_file()}
    router = APIRouter(include_in_schema=False)

    @router.get("/")
    async def status_page(request: Request) -> Response:
        """Return the status page."""
        return page.answer(request, _PAGE_HEADERS)

    @router.get("/static/{name}")
    async def static_file(request: Request, name: str) -> Response:
        """Return one of the page's files."""
        held = files.get(name)
        if held is None:
            raise HTTPException(404, f"no file {name!r} in the status page's static files")
        return held.answer(request, {"Cache-Control": "no-cache"})

    app.include_router(router)
