"""Protocol v2 (docs/protocol.md): several ranks' v1 batches in one request, framed so each can be cut out.

A v2 body is JSON, laid out exactly as :func:`encode_node_batch` writes it::

    {"protocol":2,"lengths":[812,815],"batches":[<v1 batch>,<v1 batch>]}

``lengths`` gives each inner batch's size in bytes, so the collector cuts the
body into the very bytes each rank encoded and validates (and stores) each one
as a v1 batch, answering per rank. The layout is fixed (no spaces, keys in
this order): a body laid out otherwise is refused as a whole (400).
Standard library only: the agent's node relay, the collector and the
benchmarks' load generator all use these two functions.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["NODE_PROTOCOL_VERSION", "MAX_NODE_BATCHES", "encode_node_batch", "split_node_batch", "is_node_batch"]

NODE_PROTOCOL_VERSION = 2
"""The ``protocol`` field of a node batch; its inner batches carry ``"protocol": 1``."""

MAX_NODE_BATCHES = 1024
"""Inner batches in one node batch (a node runs 8 ranks; a relay that gathers more posts several)."""

_PREFIX = b'{"protocol":2,"lengths":['
_HEAD = re.compile(rb'\{"protocol":2,"lengths":\[((?:[0-9]{1,9}(?:,[0-9]{1,9})*)?)\],"batches":\[')
_HEAD_MAX = len(_PREFIX) + MAX_NODE_BATCHES * 10 + 16


def encode_node_batch(bodies: Sequence[bytes]) -> bytes:
    """Return the v2 body carrying ``bodies`` (encoded v1 batches) in order; costs one join, no JSON work."""
    lengths = b",".join(str(len(b)).encode() for b in bodies)
    return b"".join((_PREFIX, lengths, b'],"batches":[', b",".join(bodies), b"]}"))


def is_node_batch(body: bytes) -> bool:
    """Return whether ``body`` claims to be a v2 node batch (a prefix check)."""
    return body.startswith(_PREFIX)


def split_node_batch(body: bytes) -> list[bytes] | None:
    """Return the inner batches' bytes, or ``None`` when ``body`` is not laid out as :func:`encode_node_batch` does.

    Checks only the framing (each inner batch is then validated on its own); costs one
    regular-expression match on the head and one slice per inner batch.
    """
    head = _HEAD.match(body, 0, min(len(body), _HEAD_MAX))
    if head is None:
        return None
    lengths = [int(n) for n in head.group(1).split(b",")] if head.group(1) else []
    if len(lengths) > MAX_NODE_BATCHES:
        return None
    pieces, at = [], head.end()
    for i, length in enumerate(lengths):
        if i and body[at:at + 1] != b",":
            return None
        at += 1 if i else 0
        piece = body[at:at + length]
        if len(piece) != length or not piece.startswith(b"{") or not piece.endswith(b"}"):
            return None
        pieces.append(piece)
        at += length
    return pieces if body[at:] == b"]}" else None
