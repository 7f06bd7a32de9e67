"""Write samples into a running Prometheus over its remote-write receiver, with the standard library only.

Prometheus (``--web.enable-remote-write-receiver``) takes a snappy-compressed protobuf ``WriteRequest``
at ``/api/v1/write``. Both are simple enough to write by hand: the protobuf is four message types of
two or three fields, and a snappy block made of one literal is valid (uncompressed, which loopback
does not mind). Samples written this way land in the head, as scraped ones do, so a history written
in time order is stored and read exactly as 30 minutes of scrapes would be.
"""

from __future__ import annotations

import concurrent.futures
import re
import struct
import urllib.request
from collections.abc import Iterable

__all__ = ["RemoteWriter"]

_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="([^"]*)"')
_STAMP = 6  # bytes of the varint of a time in milliseconds since 1970, from 1971 to 2109
_SAMPLE = 1 + 8 + 1 + _STAMP  # a Sample message: value tag and double, timestamp tag and varint
_SAMPLE_FIELD = 1 + 1 + _SAMPLE  # the field holding it in a TimeSeries: tag, length, message


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _snappy_literal(data: bytes) -> bytes:
    """A snappy block holding ``data`` as one literal (valid, not compressed)."""
    return _varint(len(data)) + b"\xfc" + struct.pack("<I", len(data) - 1) + data


class RemoteWriter:
    """Send ``(series, value)`` samples, the series as the text format writes it, to Prometheus servers."""

    def __init__(self, urls: list[str], labels: dict[str, str]) -> None:
        self.urls, self.labels = [url + "/api/v1/write" for url in urls], labels
        self._encoded: dict[str, bytes] = {}

    def _head(self, series: str) -> bytes:
        """The start of the series' TimeSeries field: its tag, length (with one sample) and labels."""
        head = self._encoded.get(series)
        if head is None:
            name, _, rest = series.partition("{")
            pairs = sorted([("__name__", name), *self.labels.items(), *_LABEL.findall(rest)])
            labels = b"".join(_field(1, _field(1, k.encode()) + _field(2, v.encode())) for k, v in pairs)
            head = self._encoded[series] = b"\x0a" + _varint(len(labels) + _SAMPLE_FIELD) + labels
        return head

    def write(self, t: float, samples: Iterable[tuple[str, object]]) -> None:
        """Write one sample of every series at time ``t`` (seconds) to every server."""
        stamp = _varint(int(t * 1000))
        if len(stamp) != _STAMP:
            raise ValueError(f"{t} is not a time of this century")
        sample = b"\x12" + _varint(_SAMPLE) + b"\x09"  # the Sample field: value (double), then timestamp
        stamp = b"\x10" + stamp
        pack, head = struct.Struct("<d").pack, self._head
        body = b"".join(head(series) + sample + pack(float(value)) + stamp for series, value in samples)
        body = _snappy_literal(body)
        with concurrent.futures.ThreadPoolExecutor(len(self.urls)) as pool:  # every server ingests at once
            list(pool.map(lambda url: _post(url, body), self.urls))


def _post(url: str, body: bytes) -> None:
    request = urllib.request.Request(url, data=body, method="POST", headers={
        "Content-Type": "application/x-protobuf", "Content-Encoding": "snappy",
        "X-Prometheus-Remote-Write-Version": "0.1.0"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        if answer.status // 100 != 2:
            raise RuntimeError(f"remote write to {url} answered {answer.status}")
