"""Command line: ``ampwatch-server [serve] [options]`` (more subcommands may join ``serve``)."""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections.abc import Callable, Sequence

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """Return the parser of ``ampwatch-server serve`` (also used when no subcommand is given)."""
    from ._config import add_arguments
    parser = argparse.ArgumentParser(
        prog="ampwatch-server",
        description="Run the ampwatch collector: agents POST batches to /v1/ingest, Prometheus scrapes "
                    "/metrics, and /v1/runs answers questions about runs. Usage: ampwatch-server [serve] "
                    "[options]. Every option can also be set with the AMPWATCH_SERVER_* variable shown.",
    )
    add_arguments(parser)
    return parser


def serve(argv: Sequence[str]) -> int:
    """Parse options and run the collector until interrupted."""
    import uvicorn

    from ._app import create_app
    from ._config import config_from_args
    from ._connections import ConnectionLimits, bounded_protocol, pending_cap_for
    from ._gc import tune_gc
    from ._store import prepare_database
    args = build_parser().parse_args(list(argv))
    try:
        config = config_from_args(args)
        prepare_database(config.db)  # a folder it cannot create is said now, in one line, not after "listening"
    except ValueError as exc:
        print(f"ampwatch-server: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("ampwatch.server").info(
        "ampwatch collector listening on %s://%s:%d (metrics at /metrics), storing data in %s",
        "https" if config.ssl_certfile else "http", config.host, config.port, os.path.abspath(config.db))
    # One worker on purpose: the per-rank state lives in this process.
    # access_log off: request lines carry client addresses and paths, never needed, and must never carry tokens.
    app = create_app(config)
    limits = ConnectionLimits(header_timeout=config.header_timeout, body_timeout=config.body_timeout,
                              per_client=config.max_client_connections,
                              pending_cap=pending_cap_for(_allow_open_connections()), counts=app.state.guard.refused)
    tune_gc()  # the collector's own process only: tests that build apps in-process keep the defaults
    # Forwarded headers only from the proxies named: uvicorn's default believes any local process.
    uvicorn.run(app, host=config.host, port=config.port, workers=1, log_level=config.log_level,
                access_log=False, timeout_graceful_shutdown=10, ssl_certfile=config.ssl_certfile,
                ssl_keyfile=config.ssl_keyfile, timeout_keep_alive=math.ceil(config.keep_alive),
                http=bounded_protocol(limits), proxy_headers=bool(config.forwarded_allow_ips),
                forwarded_allow_ips=config.forwarded_allow_ips or None)
    return 0


def _allow_open_connections() -> int:
    """Raise this process's open-file limit to its hard limit and return it: every rank keeps a connection open.

    A soft limit of 1,024 (a common default) would refuse connections past about a thousand ranks; the hard
    limit is what the operator (systemd, the container runtime) allows.
    """
    soft = 1024
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        wanted = max(soft, 1 << 20) if hard == resource.RLIM_INFINITY else hard  # Linux caps it at nr_open
        if soft < wanted:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
    except (ImportError, ValueError, OSError) as exc:  # not on this platform, or not allowed: keep the limit
        logging.getLogger("ampwatch.server").debug("open-file limit unchanged: %s", exc)
        return soft
    logging.getLogger("ampwatch.server").info("open-file limit %d: room for about as many agent connections", soft)
    return soft


SUBCOMMANDS: dict[str, Callable[[Sequence[str]], int]] = {"serve": serve}


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to a subcommand; without one, ``serve``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in SUBCOMMANDS:
        return SUBCOMMANDS[args[0]](args[1:])
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
