"""Collector configuration: one dataclass, each field also an ``AMPWATCH_SERVER_*`` variable and a CLI option."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, Mapping, Optional

from ampwatch.contract.protocol import COLLECTOR_DEFAULTS, TEXT_LIMITS

__all__ = ["ServerConfig", "add_arguments", "config_from_args", "ENV_PREFIX"]

ENV_PREFIX = "AMPWATCH_SERVER_"


@dataclasses.dataclass(kw_only=True, slots=True)
class ServerConfig:
    """Everything the collector process needs; build it from the CLI with :func:`config_from_args`."""

    host: str = "127.0.0.1"
    """Address to listen on (0.0.0.0 to accept agents from other machines)."""
    port: int = 9457
    """TCP port (not 9400: NVIDIA dcgm-exporter uses it on GPU nodes)."""
    db: str = "ampwatch.db"
    """SQLite database file; created if missing; WAL mode."""
    token: Optional[str] = dataclasses.field(default=None, repr=False)  # repr=False: a secret never lands in a log
    """Bearer token agents must send to ingest (none: ingest is open)."""
    read_token: Optional[str] = dataclasses.field(default=None, repr=False)
    """Bearer token readers must send to /metrics and the /v1 query API (none: reading is open)."""
    rate_limit: float = 0.0
    """Requests per second one client address may make on average, bursts up to twice that (0: no limit)."""
    ssl_certfile: Optional[str] = None
    """PEM certificate (chain) to serve HTTPS with; needs ssl_keyfile (none: plain HTTP)."""
    ssl_keyfile: Optional[str] = None
    """PEM private key of ssl_certfile."""
    silent_after: float = 60.0
    """Seconds without a batch after which a rank no longer counts in ampwatch_run_ranks_reporting."""
    expire_after: float = 3600.0
    """Seconds without a batch after which a rank disappears from /metrics (keep it above your silence alert's window)."""
    run_retention: float = 3600.0
    """Seconds a run whose ranks all closed cleanly stays in /metrics after its last close."""
    db_retention: float = 30 * 86400.0
    """Seconds of history kept in the database (runs last seen earlier are deleted)."""
    max_body_bytes: int = COLLECTOR_DEFAULTS["max_body_bytes"]
    """Largest accepted ingest body (413 above)."""
    max_runs: int = COLLECTOR_DEFAULTS["max_runs"]
    """Runs held at once (429 with Retry-After for a batch of a new run above: back-pressure, retried)."""
    max_ranks_per_run: int = COLLECTOR_DEFAULTS["max_ranks_per_run"]
    """Ranks per run (422 above: refused for good, the agent drops and counts the batch)."""
    max_optimizers_per_rank: int = COLLECTOR_DEFAULTS["max_optimizers_per_rank"]
    """Optimizers per rank (422 above: refused for good, the agent drops and counts the batch)."""
    max_label_length: int = TEXT_LIMITS["label"]
    """Longest run, optimizer or parameter name exposed as a label (422 above; parameter names are cut)."""
    log_level: str = "info"
    """Log level: debug, info, warning, error."""
    webhook: Optional[str] = None
    """Built-in alert notification targets, comma-separated ``kind:url`` (kinds webhook, alertmanager, slack)."""
    alert_thresholds: Optional[str] = None
    """Thresholds of the built-in alerts: a profile (``default``, ``demo``) or a JSON file of overrides."""

    def __post_init__(self) -> None:
        checks = [
            ("port", 0 <= self.port <= 65535, "must be between 0 and 65535"),
            ("db", bool(self.db), "must name a file"),
            ("silent_after", self.silent_after > 0, "must be > 0 seconds"),
            ("expire_after", self.expire_after >= self.silent_after, "must be >= silent_after"),
            ("run_retention", self.run_retention >= 0, "must be >= 0 seconds"),
            ("db_retention", self.db_retention >= self.expire_after, "must be >= expire_after"),
            ("max_body_bytes", self.max_body_bytes >= 1024, "must be >= 1024"),
            ("max_runs", self.max_runs >= 1, "must be >= 1"),
            ("max_ranks_per_run", self.max_ranks_per_run >= 1, "must be >= 1"),
            ("max_optimizers_per_rank", self.max_optimizers_per_rank >= 1, "must be >= 1"),
            ("max_label_length", 1 <= self.max_label_length <= TEXT_LIMITS["label"],
             f"must be between 1 and {TEXT_LIMITS['label']} (the protocol's limit)"),
            ("rate_limit", self.rate_limit >= 0, "must be >= 0 requests per second (0 turns the limit off)"),
            ("ssl_keyfile", bool(self.ssl_certfile) == bool(self.ssl_keyfile),
             "and ssl_certfile must be given together"),
            ("log_level", self.log_level in ("debug", "info", "warning", "error"),
             "must be one of debug, info, warning, error"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} {rule} "
                                 f"(set by --{name.replace('_', '-')} or {ENV_PREFIX}{name.upper()})")
        if self.webhook:
            from .alerting.notifications import parse_targets
            parse_targets(self.webhook)  # a bad entry raises a ValueError saying what to write
        from .alerting.thresholds import load_thresholds
        load_thresholds(self.alert_thresholds)  # a bad file raises a ValueError naming the field


# Text options where an empty value (e.g. AMPWATCH_SERVER_TOKEN="") means "not set".
_OPTIONAL_TEXT = ("token", "read_token", "ssl_certfile", "ssl_keyfile", "webhook")

# Short forms of the field docstrings above, for --help.
_DOCS = {
    "host": "address to listen on (0.0.0.0 accepts agents from other machines)",
    "port": "TCP port (9457; not 9400, which NVIDIA dcgm-exporter uses)",
    "db": "SQLite database file, created if missing (WAL mode)",
    "token": "bearer token agents must send to /v1/ingest (default: none, ingest open)",
    "read_token": "bearer token readers (Prometheus, scripts) must send to /metrics and /v1/* "
                  "(default: none, reading open)",
    "rate_limit": "requests per second per client address, bursts up to twice that; 429 above (0: off)",
    "ssl_certfile": "PEM certificate to serve HTTPS (with --ssl-keyfile)",
    "ssl_keyfile": "PEM private key for --ssl-certfile",
    "silent_after": "seconds without a batch before a rank stops counting as reporting",
    "expire_after": "seconds without a batch before a rank leaves /metrics "
                    "(keep above the silence alert's threshold + for)",
    "run_retention": "seconds a cleanly closed run stays in /metrics",
    "db_retention": "seconds of history kept in the database",
    "max_body_bytes": "largest ingest body in bytes (413 above)",
    "max_runs": "runs held at once (429 + Retry-After above: agents retry)",
    "max_ranks_per_run": "ranks per run (422 above: refused for good)",
    "max_optimizers_per_rank": "optimizers per rank (422 above: refused for good)",
    "max_label_length": "longest run/optimizer name (422 above; parameter names are cut to it)",
    "log_level": "debug, info, warning or error",
    "alert_thresholds": "thresholds of the built-in alerts: 'demo' (seconds-long windows, for `make demo`) "
                        "or a JSON file of ampwatch.contract.thresholds fields to override",
    "webhook": "alert notification targets, comma-separated kind:url with kind webhook (Alertmanager "
               "webhook payload), alertmanager (its base URL; v2 API) or slack (incoming webhook)",
}


def add_arguments(parser: argparse.ArgumentParser, environ: Optional[Mapping[str, str]] = None) -> None:
    """Add one ``--option`` per config field, defaulting to its ``AMPWATCH_SERVER_*`` variable."""
    env = os.environ if environ is None else environ
    for field in dataclasses.fields(ServerConfig):
        var = ENV_PREFIX + field.name.upper()
        kind: Any = {"int": int, "float": float}.get(str(field.type), str)
        default = field.default
        parser.add_argument(
            # No type= here: values (flag or env) are converted in config_from_args, whose error names both.
            "--" + field.name.replace("_", "-"), dest=field.name, default=env.get(var, default),
            metavar={int: "N", float: "SECONDS"}.get(kind, field.name.split("_")[-1].upper()),
            help=f"{_DOCS[field.name]} [env {var}; default {default}]")


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Build a validated config from parsed arguments (env values are converted here)."""
    values = {}
    for field in dataclasses.fields(ServerConfig):
        raw = getattr(args, field.name)
        kind = {"int": int, "float": float}.get(str(field.type))
        if raw is not None and kind is not None and isinstance(raw, str):
            try:
                raw = kind(raw)
            except ValueError:
                raise ValueError(f"--{field.name.replace('_', '-')} / {ENV_PREFIX}{field.name.upper()}={raw!r} is not "
                                 f"a valid {kind.__name__}") from None
        values[field.name] = None if raw == "" and field.name in _OPTIONAL_TEXT else raw
    return ServerConfig(**values)
