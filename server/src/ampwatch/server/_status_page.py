"""Serve the status page: ``GET /`` and its static files (no build step, nothing fetched from elsewhere).

The files are read once, when the app is made, and answered from memory: an answer costs one turn
of the event loop, where a file answer read its file in a worker thread, hopping back to the busy
event loop for each step (in a whole-job storm that put seconds between the page's HTML and its
scripts). The page carries its scripts (each ``<script src="static/NAME.js"></script>`` of
index.html, in its order: small files, one concern each) and style sheet inline, allowed by their
hashes in its Content-Security-Policy (nothing else inline runs): the run's summary is then asked for
one round trip after the HTML, not two. Each answer has an ETag; a browser revalidating
(``Cache-Control: no-cache``) gets a 304.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import pathlib
import re

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.responses import Response

__all__ = ["STATIC_DIR", "mount_status_page"]

STATIC_DIR = pathlib.Path(__file__).with_name("static")

_MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                ".css": "text/css; charset=utf-8"}

_SCRIPT = re.compile(r'<script src="static/([\w.-]+\.js)"></script>')
_STYLE = '<link rel="stylesheet" href="static/style.css">'


def _policy(scripts: list[str], style: str) -> str:
    """The page's Content-Security-Policy: it only talks to this collector, and runs no inline script or style
    but its own (by hash), so injected markup stays inert."""
    def digest(text: str) -> str:
        return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"
    return (f"default-src 'self'; img-src 'self' data:; style-src 'self' {digest(style)}; "
            f"script-src 'self' {' '.join(map(digest, scripts))}; connect-src 'self'; base-uri 'none'; "
            f"frame-ancestors 'none'")


@dataclasses.dataclass(frozen=True)
class _File:
    body: bytes
    media_type: str
    etag: str

    @classmethod
    def of(cls, body: bytes, suffix: str) -> _File:
        return cls(body, _MEDIA_TYPES.get(suffix, "application/octet-stream"),
                   '"' + hashlib.sha256(body).hexdigest()[:20] + '"')

    def answer(self, request: Request, headers: dict[str, str]) -> Response:
        """The file, or 304 when the browser already holds this version."""
        headers = {**headers, "ETag": self.etag}
        if self.etag in request.headers.get("if-none-match", ""):
            return Response(status_code=304, headers=headers)
        return Response(self.body, media_type=self.media_type, headers=headers)


def mount_status_page(app: FastAPI) -> None:
    """Add ``/`` and ``/static/<file>`` to the collector app (the files read now, into memory)."""
    files = {path.name: _File.of(path.read_bytes(), path.suffix) for path in STATIC_DIR.iterdir() if path.is_file()}
    style, html = files["style.css"].body.decode(), files["index.html"].body.decode()
    loaded = _SCRIPT.findall(html)
    unknown = [name for name in loaded if name not in files]
    left_out = sorted(name for name in files if name.endswith(".js") and name not in loaded)
    if _STYLE not in html or not loaded or unknown or left_out:
        raise RuntimeError(f"static/index.html must load its style as {_STYLE} and each script of static/ as "
                           f'<script src="static/NAME.js"></script> (not found: {unknown}, not loaded: {left_out})')
    scripts = [files[name].body.decode() for name in loaded]
    html = _SCRIPT.sub(lambda tag: f"<script>{files[tag.group(1)].body.decode()}</script>",
                       html.replace(_STYLE, f"<style>{style}</style>"))
    page = _File.of(html.encode(), ".html")
    headers = {"Content-Security-Policy": _policy(scripts, style), "Cache-Control": "no-cache"}
    router = APIRouter(include_in_schema=False)

    @router.get("/")
    async def status_page(request: Request) -> Response:
        """Return the status page."""
        return page.answer(request, headers)

    @router.get("/static/{name}")
    async def static_file(request: Request, name: str) -> Response:
        """Return one of the page's files."""
        held = files.get(name)
        if held is None:
            raise HTTPException(404, f"no file {name!r} in the status page's static files")
        return held.answer(request, {"Cache-Control": "no-cache"})

    app.include_router(router)
