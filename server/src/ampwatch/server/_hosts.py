"""The names the collector answers to: the ``Host`` allow-list that keeps DNS rebinding out.

A web page whose own name its owner rebinds to 127.0.0.1 (or to the collector's address) reaches
the collector from the user's browser with that name in ``Host`` and ``Origin``, so comparing the two
proves nothing. A browser always sends the name it resolved, so refusing every name the collector does
not serve refuses those pages. An address in ``Host`` cannot come from rebinding (there is no name to
rebind), and neither can ``localhost`` (browsers resolve it, and its subdomains, to loopback themselves).

Served by default: loopback names and addresses; the address the collector is bound to; bound to every
interface (``0.0.0.0``, ``::``), any address and this machine's host name. ``--allowed-hosts`` adds
names (a leading dot: the name and its subdomains; ``*``: any name, which turns the check off).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable

__all__ = ["HostAllowList", "parse_names", "host_name"]

_WILDCARDS = ("0.0.0.0", "::", "")
_CACHE_LIMIT = 256  # distinct Host values remembered; past it each is judged afresh (a flood of names)


def parse_names(text: str) -> tuple[str, ...]:
    """Read ``--allowed-hosts``: comma-separated names, ``.suffix`` or ``*``; raise ValueError naming a bad one."""
    names = []
    for raw in text.split(","):
        name = raw.strip().lower().rstrip(".")
        if not name:
            continue
        if name != "*" and (any(c in name for c in "/:@ *") or not name.lstrip(".")):
            raise ValueError(f"--allowed-hosts entry {raw.strip()!r} is not a host name: give names as agents and "
                             "browsers write them, without scheme or port (collector.example, .example.internal "
                             "for a domain and its subdomains, or * for any name)")
        names.append(name)
    return tuple(names)


def host_name(authority: bytes) -> str | None:
    """Return the host name of a ``Host`` value (``name``, ``name:port``, ``[v6]:port``), lowercased, or None when
    it is none of those (``[::1]evil.example``, ``[localhost]``, ``::1`` unbracketed, a port not of digits)."""
    text = authority.decode("latin-1").strip().lower()
    if text.startswith("["):
        end = text.find("]")
        if end < 0 or not _port_or_nothing(text[end + 1:]):
            return None
        try:
            return str(ipaddress.IPv6Address(text[1:end]))
        except ValueError:
            return None
    name, colon, port = text.rpartition(":")
    if colon:
        if ":" in name or not _port_or_nothing(colon + port):
            return None
        text = name
    return text.rstrip(".") or None


def _port_or_nothing(text: str) -> bool:
    """Tell whether ``text`` (what follows the host in a ``Host`` value) is empty or ``:`` and ASCII digits."""
    return not text or (text[0] == ":" and text[1:].isascii() and text[1:].isdigit())


class HostAllowList:
    """Tell whether a request's ``Host`` names this collector; one per app, O(1) per request (cached)."""

    def __init__(self, bind: str, names: Iterable[str] = ()) -> None:
        names = tuple(names)
        self.any_name = "*" in names
        self.any_address = bind.strip("[]") in _WILDCARDS
        self.exact = {n for n in names if not n.startswith(".") and n != "*"}
        self.suffixes = tuple(n for n in names if n.startswith("."))
        self.addresses: set = set()
        bound = bind.strip("[]").lower()
        try:
            self.addresses.add(ipaddress.ip_address(bound))
        except ValueError:
            self.exact.add(bound)  # bound to a name: that name is served
        if self.any_address:  # every interface: agents may use this machine's own name
            self.exact.update(n.lower() for n in (socket.gethostname(), socket.getfqdn()) if n)
        self._judged: dict[bytes, bool] = {}

    @classmethod
    def of(cls, config) -> HostAllowList:  # noqa: ANN001 - a ServerConfig (no import cycle)
        return cls(config.host, config.allowed_hosts)

    def allows(self, authority: bytes | None) -> bool:
        """Tell whether a request whose ``Host`` header is ``authority`` is for this collector.

        A request without ``Host`` (HTTP/1.0 from a script) passes: browsers always send one.
        """
        if authority is None or self.any_name:
            return True
        judged = self._judged.get(authority)
        if judged is None:
            name = host_name(authority)
            judged = name is not None and self.serves(name)
            if len(self._judged) < _CACHE_LIMIT:
                self._judged[authority] = judged
        return judged

    def serves(self, name: str) -> bool:
        """Tell whether this collector answers to the host ``name`` (lowercased, no port)."""
        if self.any_name or name == "localhost" or name.endswith(".localhost") or name in self.exact:
            return True
        try:
            address = ipaddress.ip_address(name)
        except ValueError:
            return any(name == s[1:] or name.endswith(s) for s in self.suffixes)
        return address.is_loopback or self.any_address or address in self.addresses

    def describe(self) -> str:
        """Say which names are served, for a refusal's message."""
        served = ["localhost", "loopback addresses"]
        if self.any_address:
            served.append("any address")
        served += sorted(str(a) for a in self.addresses if not a.is_loopback and not self.any_address)
        served += sorted(n for n in self.exact if n not in ("localhost", "0.0.0.0", "::"))
        served += [f"*{s}" for s in self.suffixes]
        return ", ".join(served)
