"""Serve the status page: ``GET /`` and its static files (no build step, nothing fetched from elsewhere)."""

from __future__ import annotations

import pathlib

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

__all__ = ["STATIC_DIR", "mount_status_page"]

STATIC_DIR = pathlib.Path(__file__).with_name("static")

_router = APIRouter(include_in_schema=False)


@_router.get("/")
async def status_page() -> FileResponse:
    """Return the status page."""
    # The page only talks to this collector; a strict policy keeps any injected markup inert.
    return FileResponse(STATIC_DIR / "index.html", headers={
        "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; "
                                   "script-src 'self'; connect-src 'self'; base-uri 'none'; frame-ancestors 'none'",
        "Cache-Control": "no-cache"})


def mount_status_page(app: FastAPI) -> None:
    """Add ``/`` and ``/static/`` to the collector app."""
    app.include_router(_router)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
