"""Collector configuration: one dataclass, each field also an ``AMPWATCH_SERVER_*`` variable and a CLI option.

Each field is declared once, with its default, its help text (``--help`` shows it) and,
where the command line gives text for a richer value, the parser that turns the text
into it; :func:`config_from_args` parses once, so the app receives typed values.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
from collections.abc import Callable, Mapping
from typing import Any

from ampwatch.contract.placement import BLOCK_RANKS, normalize
from ampwatch.contract.protocol import COLLECTOR_DEFAULTS, KEEP_ALIVE_S, TEXT_LIMITS
from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS, AlertThresholds

from ._hosts import parse_names
from .alerting.grouping import REPEAT_INTERVAL_S
from .alerting.notifications import Target, parse_targets
from .alerting.thresholds import load_thresholds

__all__ = ["ServerConfig", "add_arguments", "config_from_args", "ENV_PREFIX"]

ENV_PREFIX = "AMPWATCH_SERVER_"


def _boolean(text: str) -> bool:
    """Read a yes/no setting: 1/true/yes/on or 0/false/no/off (any case)."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"{text!r} is not a yes/no value (1/true/yes/on or 0/false/no/off)")


_PARSERS: dict[type, Callable[[str], Any]] = {int: int, float: float, bool: _boolean}  # by the default's type

def _number(text: str) -> float:
    """A number that is no duration (its option's name says its unit: days, a ratio)."""
    return float(text)


def parse_peers(text: str) -> tuple[str, ...]:
    """Read ``--peers``: collector URLs, comma-separated, as the agents' ``AMPWATCH_URL`` lists them."""
    urls = tuple(dict.fromkeys(normalize(url) for url in text.split(",") if url.strip()))
    for url in urls:
        if not url.startswith(("http://", "https://")) or url.count("/") != 2:
            raise ValueError(f"--peers / {ENV_PREFIX}PEERS must be http(s)://host[:port] URLs separated by commas "
                             f"(the agents' AMPWATCH_URL), got {url!r}")
    return urls


def _option(default: Any, help: str, *, parse: Callable[[str], Any] | None = None, shown: str | None = None,
            secret: bool = False) -> Any:
    """Declare a field: its default, its ``--help`` text, the parser of its text form, how --help shows the default.

    Without ``parse``, text is converted to the default's type (int, float) or kept (str; an empty
    value of a field that defaults to None means "not set").
    """
    parse = parse or _PARSERS.get(type(default))
    metadata = {"help": help, "parse": parse, "shown": shown if shown is not None else default}
    # repr=False: a secret never lands in a log.
    return dataclasses.field(default=default, repr=not secret, metadata=metadata)


@dataclasses.dataclass(kw_only=True, slots=True)
class ServerConfig:
    """Everything the collector process needs; build it from the CLI with :func:`config_from_args`."""

    host: str = _option("127.0.0.1", "address to listen on (0.0.0.0 accepts agents from other machines, and then "
                                     "needs --token or --token-file, or --insecure)")
    port: int = _option(9457, "TCP port (9457; not 9400, which NVIDIA dcgm-exporter uses)")
    db: str = _option("ampwatch.db", "SQLite database file, created if missing (WAL mode)")
    token: str | None = _option(None, "bearer token agents must send to /v1/ingest (default: none, ingest open; "
                                         "prefer --token-file: a command line shows in ps)", secret=True)
    token_file: str | None = _option(None, "file holding the ingest token (read once at start; surrounding "
                                              "white space ignored)")
    read_token: str | None = _option(None, "bearer token readers (Prometheus, scripts, the status page) must send "
                                              "to /metrics and /v1/* (default: none, reading open)", secret=True)
    read_token_file: str | None = _option(None, "file holding the read token")
    insecure: bool = _option(False, "listen on a non-loopback address without an ingest token (anyone who reaches "
                                    "the port can then write into the collector)")
    allowed_hosts: tuple[str, ...] = _option(
        (), "host names agents, Prometheus and browsers reach the collector by, comma-separated, besides those "
            "served anyway: localhost and loopback addresses, the --host address, and with --host 0.0.0.0 any "
            "address and this machine's name. A request for another name gets 421 (a web page rebinding its own "
            "name to this address). .example.internal: that domain and its subdomains; *: any name",
        parse=parse_names, shown="none")
    forwarded_allow_ips: str = _option("", "addresses of reverse proxies whose X-Forwarded-For and "
                                           "X-Forwarded-Proto are believed, comma-separated (uvicorn's "
                                           "forwarded_allow_ips; * for any). Default: none, so no client picks "
                                           "the address its per-client limits count against")
    api_docs: bool = _option(False, "serve the interactive API docs at /docs (Swagger UI, which the browser loads "
                                    "from a public CDN); /openapi.json is always served")
    rate_limit: float = _option(0.0, "requests per second per client address, bursts up to twice that; 429 above "
                                     "(0: off)")
    keep_alive: float = _option(float(KEEP_ALIVE_S), "seconds an idle kept-alive agent connection stays open; keep it "
                                                   "above 1.5 x the agents' AMPWATCH_PUSH_INTERVAL "
                                                   "(15-30 s by default), so that each batch reuses its rank's "
                                                   "connection instead of opening one")
    header_timeout: float = _option(10.0, "seconds a connection has to send a request's headers, from when it "
                                          "opens or the request's first byte; closed after (agents send theirs "
                                          "at once)")
    body_timeout: float = _option(60.0, "seconds a request's body may take after its headers; the connection is "
                                        "closed after")
    max_client_connections: int = _option(4096, "connections one client address may hold open at once; more are "
                                                "closed as they open (0: no limit). Raise it behind a NAT or proxy "
                                                "that fronts more ranks than this")
    ssl_certfile: str | None = _option(None, "PEM certificate to serve HTTPS (with --ssl-keyfile)")
    ssl_keyfile: str | None = _option(None, "PEM private key for --ssl-certfile")
    silent_after: float = _option(  # None until __post_init__: then the silence alert's threshold
        None, "seconds without a batch before a rank stops counting as reporting (default: the AmpRankSilent "
              "threshold silent_after_s of --alert-thresholds, 120 s: 8 heartbeats of the agents' default "
              "AMPWATCH_PUSH_INTERVAL)", parse=float, shown="silent_after_s")
    expire_after: float = _option(3600.0, "seconds without a batch before a rank leaves /metrics (keep above the "
                                          "silence alert's threshold + for)")
    run_retention: float = _option(3600.0, "seconds a cleanly closed run stays in /metrics")
    db_retention: float = _option(30 * 86400.0, "seconds of history kept in the database")
    suspect_events: int = _option(3, "events with different samples that make a device the sole origin of a suspect "
                                     "(GET /v1/suspects, AmpSuspectDevice; docs/suspects.md)")
    suspect_max_origins: int = _option(1, "most origin ranks an event may have and still count against a device; "
                                          "more is a whole-job overflow (docs/suspects.md)")
    suspect_stand_out_ratio: float = _option(3.0, "a suspect device's events must be at least this many times the "
                                                  "median of its runs' other devices' (0: off; docs/suspects.md)",
                                             parse=_number)
    suspect_retention_days: float = _option(90.0, "days the suspects' evidence is kept, across runs and restarts",
                                            parse=_number)
    suspect_max_rows: int = _option(50_000, "evidence rows kept at most (the oldest go first); bounds "
                                             "GET /v1/suspects' work")
    max_body_bytes: int = _option(COLLECTOR_DEFAULTS["max_body_bytes"], "largest ingest body in bytes (413 above)")
    max_runs: int = _option(COLLECTOR_DEFAULTS["max_runs"], "runs held at once (429 + Retry-After above: agents "
                                                            "retry)")
    max_ranks_per_run: int = _option(COLLECTOR_DEFAULTS["max_ranks_per_run"],
                                     "ranks per run (422 above: refused for good)")
    max_optimizers_per_rank: int = _option(COLLECTOR_DEFAULTS["max_optimizers_per_rank"],
                                           "optimizers per rank (422 above: refused for good)")
    max_label_length: int = _option(TEXT_LIMITS["label"], "longest run/optimizer name (422 above; parameter names "
                                                          "are cut to it)")
    client_new_runs: int = _option(300, "new runs one client address may open per hour, all at once if it likes; "
                                        "429 + Retry-After above, so one client cannot fill --max-runs (0: off)")
    client_event_rate: float = _option(2000.0, "events per second one client address may send, bursts of ten "
                                               "seconds' worth (at least one full batch); 429 + Retry-After above "
                                               "(0: off)")
    max_counter_rate: float = _option(10_000.0, "plausibility bound: a counter may rise by at most this many per "
                                                "second of the agent's clock between two batches of one process "
                                                "(plus a minute's worth; a first batch: a day's worth); 422 above. "
                                                "Training loops count at most a few thousand per second (0: off)")
    require_process_key: bool = _option(False, "refuse (422) batches without a process_key: agents before it, "
                                               "whose ranks anyone holding the ingest token can speak for "
                                               "(docs/security.md#what-a-token-holder-can-do-to-another-rank)")
    peers: tuple[str, ...] = _option(
        (), "every collector of this deployment, this one included, comma-separated, exactly as the agents' "
            "AMPWATCH_URL lists them: runs are placed on them by the same rule (docs/scaling.md), and "
            "GET /v1/runs and the page's run list show the runs of all of them", parse=parse_peers, shown="none")
    advertise_url: str | None = _option(None, "this collector's own URL in --peers (default: the one entry of "
                                              "--peers whose port is --port, if exactly one is)")
    block_ranks: int = _option(BLOCK_RANKS, "ranks of one run a collector holds before the run is split into "
                                            "blocks over --peers; the agents' AMPWATCH_BLOCK_RANKS must be the same")
    log_level: str = _option("info", "debug, info, warning or error")
    webhook: tuple[Target, ...] = _option(
        (), "alert notification targets, comma-separated kind:url with kind webhook (Alertmanager webhook payload), "
            "alertmanager (its base URL; v2 API) or slack (incoming webhook)", parse=parse_targets, shown="none")
    webhook_file: str | None = _option(None, "file holding --webhook's text (webhook URLs often carry secrets)")
    notify_group_wait: float = _option(5.0, "seconds a new webhook/Slack notification group (one alert name in one "
                                            "run) waits for the rest of its ranks (Alertmanager's group_wait)")
    notify_group_interval: float = _option(60.0, "at most one webhook/Slack notification per group this often, "
                                                 "firing or resolved (Alertmanager's group_interval)")
    notify_repeat_interval: float = _option(REPEAT_INTERVAL_S, "seconds after which a webhook/Slack group still "
                                                               "firing with nothing new is notified again "
                                                               "(Alertmanager's repeat_interval)")
    alert_thresholds: AlertThresholds = _option(
        DEFAULT_THRESHOLDS, "thresholds of the built-in alerts: 'demo' (seconds-long windows, for `make demo`) or a "
                            "JSON file of ampwatch.contract.thresholds fields to override",
        parse=load_thresholds, shown="'default'")

    def __post_init__(self) -> None:
        self._read_secret_files()
        if self.silent_after is None:  # one definition of "silent": the alert's, which follows the heartbeat
            thresholds = self.alert_thresholds if isinstance(self.alert_thresholds, AlertThresholds) \
                else DEFAULT_THRESHOLDS  # a wrong type is reported by the checks below
            self.silent_after = float(thresholds.silent_after_s)
        checks = [
            ("host", _is_loopback(self.host) or bool(self.token) or self.insecure,
             "is not a loopback address, so agents on other machines could reach it, and no ingest token is set: "
             "anyone reaching the port could write into the collector. Give --token-file FILE (or --token, or "
             "AMPWATCH_SERVER_TOKEN) and AMPWATCH_TOKEN on the agents, or pass --insecure to accept that"),
            ("port", 0 <= self.port <= 65535, "must be between 0 and 65535"),
            ("db", bool(self.db), "must name a file"),
            ("silent_after", self.silent_after > 0, "must be > 0 seconds"),
            ("keep_alive", self.keep_alive > 0, "must be > 0 seconds"),
            ("header_timeout", self.header_timeout > 0, "must be > 0 seconds"),
            ("body_timeout", self.body_timeout > 0, "must be > 0 seconds"),
            ("max_client_connections", self.max_client_connections >= 0, "must be >= 0 (0 turns the limit off)"),
            ("allowed_hosts", isinstance(self.allowed_hosts, tuple), "must be a tuple of names (parse_names() reads "
                                                                    "the text form)"),
            ("expire_after", self.expire_after >= self.silent_after, "must be >= silent_after"),
            ("run_retention", self.run_retention >= 0, "must be >= 0 seconds"),
            ("db_retention", self.db_retention >= self.expire_after, "must be >= expire_after"),
            ("suspect_events", self.suspect_events >= 1, "must be >= 1"),
            ("suspect_max_origins", self.suspect_max_origins >= 1, "must be >= 1"),
            ("suspect_stand_out_ratio", self.suspect_stand_out_ratio >= 0, "must be >= 0 (0 turns it off)"),
            ("suspect_retention_days", self.suspect_retention_days > 0, "must be > 0 days"),
            ("suspect_max_rows", self.suspect_max_rows >= 1, "must be >= 1"),
            ("max_body_bytes", self.max_body_bytes >= 1024, "must be >= 1024"),
            ("max_runs", self.max_runs >= 1, "must be >= 1"),
            ("max_ranks_per_run", self.max_ranks_per_run >= 1, "must be >= 1"),
            ("max_optimizers_per_rank", self.max_optimizers_per_rank >= 1, "must be >= 1"),
            ("max_label_length", 1 <= self.max_label_length <= TEXT_LIMITS["label"],
             f"must be between 1 and {TEXT_LIMITS['label']} (the protocol's limit)"),
            ("client_new_runs", self.client_new_runs >= 0, "must be >= 0 (0 turns the limit off)"),
            ("client_event_rate", self.client_event_rate >= 0, "must be >= 0 per second (0 turns the limit off)"),
            ("max_counter_rate", self.max_counter_rate >= 0, "must be >= 0 per second (0 turns the bound off)"),
            ("rate_limit", self.rate_limit >= 0, "must be >= 0 requests per second (0 turns the limit off)"),
            ("ssl_keyfile", bool(self.ssl_certfile) == bool(self.ssl_keyfile),
             "and ssl_certfile must be given together"),
            ("peers", isinstance(self.peers, tuple), "must be a tuple of URLs (parse_peers() reads the text form)"),
            ("block_ranks", self.block_ranks >= 1, "must be >= 1"),
            ("log_level", self.log_level in ("debug", "info", "warning", "error"),
             "must be one of debug, info, warning, error"),
            ("webhook", isinstance(self.webhook, tuple) and all(isinstance(t, Target) for t in self.webhook),
             "must be a tuple of notification targets (parse_targets() reads the text form)"),
            ("notify_group_wait", self.notify_group_wait >= 0, "must be >= 0 seconds"),
            ("notify_group_interval", self.notify_group_interval >= 0, "must be >= 0 seconds"),
            ("notify_repeat_interval", self.notify_repeat_interval > 0, "must be > 0 seconds"),
            ("alert_thresholds", isinstance(self.alert_thresholds, AlertThresholds),
             "must be AlertThresholds (load_thresholds() reads a profile name or a JSON file)"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} {rule} "
                                 f"(set by --{name.replace('_', '-')} or {ENV_PREFIX}{name.upper()})")
        self._find_own_url()

    def _find_own_url(self) -> None:
        """Resolve ``advertise_url``: given (then one of ``peers``), or the one peer on this port."""
        if self.advertise_url is not None:
            self.advertise_url = normalize(self.advertise_url)
            if self.peers and self.advertise_url not in self.peers:
                raise ValueError(f"advertise_url={self.advertise_url!r} is not one of --peers {list(self.peers)}: "
                                 f"list this collector in --peers as the agents reach it")
            return
        if not self.peers:
            return
        mine = [url for url in self.peers if url.rsplit(":", 1)[-1] == str(self.port)]
        if len(mine) != 1:
            raise ValueError(f"cannot tell which of --peers {list(self.peers)} is this collector ({len(mine)} have "
                             f"port {self.port}): give --advertise-url (or {ENV_PREFIX}ADVERTISE_URL)")
        self.advertise_url = mine[0]

    def _read_secret_files(self) -> None:
        """Fill ``token``, ``read_token`` and ``webhook`` from their ``*_file`` options (once, at start)."""
        for name in ("token", "read_token", "webhook"):
            path = getattr(self, name + "_file")
            if path is None:
                continue
            if getattr(self, name):
                raise ValueError(f"give --{name.replace('_', '-')} or --{name.replace('_', '-')}-file, not both")
            try:
                with open(path, encoding="utf-8") as file:
                    text = file.read().strip()
            except OSError as error:
                raise ValueError(f"--{name.replace('_', '-')}-file {path!r} cannot be read: {error.strerror}") from None
            if not text:
                raise ValueError(f"--{name.replace('_', '-')}-file {path!r} is empty")
            setattr(self, name, parse_targets(text) if name == "webhook" else text)


def _is_loopback(host: str) -> bool:
    """Tell whether ``host`` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name, or 0.0.0.0 / :: (every interface)


def add_arguments(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """Add one ``--option`` per config field, defaulting to its ``AMPWATCH_SERVER_*`` variable."""
    env = os.environ if environ is None else environ
    for field in dataclasses.fields(ServerConfig):
        var = ENV_PREFIX + field.name.upper()
        parse = field.metadata["parse"]
        if field.default is False:  # a yes/no setting: a flag on the command line, yes/no in the variable
            parser.add_argument("--" + field.name.replace("_", "-"), dest=field.name, action="store_const",
                                const="1", default=env.get(var, "0"),
                                help=f"{field.metadata['help']} [env {var}=1]")
            continue
        parser.add_argument(
            # No type= here: values (flag or env) are parsed in config_from_args, whose error names both.
            "--" + field.name.replace("_", "-"), dest=field.name, default=env.get(var, field.default),
            metavar={int: "N", float: "SECONDS"}.get(parse, field.name.split("_")[-1].upper()),
            help=f"{field.metadata['help']} [env {var}; default {field.metadata['shown']}]")


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Build a validated config from parsed arguments, parsing each text value (flag or env) once."""
    values = {}
    for field in dataclasses.fields(ServerConfig):
        raw = getattr(args, field.name)
        parse = field.metadata["parse"]
        if isinstance(raw, str) and field.default is None and raw == "":
            raw = None  # e.g. AMPWATCH_SERVER_TOKEN="": not set
        elif isinstance(raw, str) and parse is not None:
            try:
                raw = parse(raw)
            except ValueError:
                kind = {int: "a valid int", float: "a valid float",
                        _boolean: "a yes/no value (1/true/yes/on or 0/false/no/off)"}.get(parse)
                if kind is not None:
                    raise ValueError(f"--{field.name.replace('_', '-')} / {ENV_PREFIX}{field.name.upper()}={raw!r} "
                                     f"is not {kind}") from None
                raise  # the field's own parser names the option and says what to write
        values[field.name] = raw
    return ServerConfig(**values)
