"""Agent configuration: keyword arguments of ``watch()`` over ``AMPWATCH_*`` environment variables."""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

__all__ = ["AgentConfig"]


@dataclasses.dataclass(kw_only=True, slots=True)
class AgentConfig:
    """Everything the agent needs besides the scaler and optimizers.

    Build it with :meth:`from_env`; explicit arguments win over the environment.
    """

    collectors: tuple[str, ...] = ()
    """Collector base URLs (``AMPWATCH_URL``, comma-separated). Empty: record only, send nothing."""
    run: str | None = None
    """Run id shared by all ranks (``AMPWATCH_RUN``); resolved from the launcher when ``None``."""
    token: str | None = None
    """Bearer token for ingest (``AMPWATCH_TOKEN``)."""
    push_interval: float = 1.0
    """Seconds between batches (``AMPWATCH_PUSH_INTERVAL``)."""
    spool_dir: str | None = None
    """Directory for an on-disk spool of unsent batches (``AMPWATCH_SPOOL_DIR``)."""
    disabled: bool = False
    """``AMPWATCH_DISABLED=1``: ``watch()`` returns a do-nothing object."""

    @classmethod
    def from_env(cls, *, collector: str | Sequence[str] | None = None, run: str | None = None,
                 token: str | None = None, push_interval: float | None = None,
                 spool_dir: str | None = None, environ: dict[str, str] | None = None) -> "AgentConfig":
        """Merge explicit arguments over ``AMPWATCH_*`` variables (placeholder; delivery work fills it)."""
        env = os.environ if environ is None else environ
        raw = collector if collector is not None else env.get("AMPWATCH_URL", "")
        urls = tuple(u.strip().rstrip("/") for u in ([raw] if isinstance(raw, str) else raw)
                     for u in u.split(",") if u.strip()) if raw else ()
        return cls(collectors=urls, run=run or env.get("AMPWATCH_RUN") or None,
                   token=token or env.get("AMPWATCH_TOKEN") or None,
                   push_interval=push_interval if push_interval is not None else 1.0,
                   spool_dir=spool_dir or env.get("AMPWATCH_SPOOL_DIR") or None,
                   disabled=env.get("AMPWATCH_DISABLED", "") not in ("", "0", "false", "no"))
