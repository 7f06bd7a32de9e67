"""One check's outcome, as printed (one line) and written to the JSON."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["FAILING", "check", "guarded", "line", "verdict"]

FAILING = ("fail", "error")
"""Statuses that make ``python -m bench.gpu`` exit non-zero."""


def check(section: str, name: str, status: str, detail: str, **data: Any) -> dict[str, Any]:
    """Return a check: ``status`` is pass, fail (a truth or sync mismatch), skip (could not run here:
    ``detail`` says why), info (measured, not judged) or error (the check itself crashed)."""
    assert status in ("pass", "fail", "skip", "info", "error"), status
    return {"section": section, "name": name, "status": status, "detail": detail, **data}


def verdict(section: str, name: str, problems: list[str], ok_detail: str, **data: Any) -> dict[str, Any]:
    """Return a pass with ``ok_detail`` when ``problems`` is empty, else a fail listing them."""
    if problems:
        return check(section, name, "fail", "; ".join(problems[:12]) + (" ..." if len(problems) > 12 else ""),
                     problems=problems, **data)
    return check(section, name, "pass", ok_detail, **data)


def guarded(section: str, name: str, run: Callable[[], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Run a group of checks; if it raises, return one error check with the traceback's last lines."""
    try:
        return run()
    except Exception as error:  # noqa: BLE001 - one broken check must not lose the others
        tail = "".join(traceback.format_exception(error)[-3:]).strip().replace("\n", " | ")
        return [check(section, name, "error", f"{type(error).__name__}: {error}", traceback=tail)]


def line(c: dict[str, Any]) -> str:
    """Return the check as one printed line."""
    return f"{c['status'].upper():5} {c['section']}/{c['name']}: {c['detail']}"
