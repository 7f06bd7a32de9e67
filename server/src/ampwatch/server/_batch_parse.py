"""Read a request body into a :class:`~._schema.Batch`: decoded and validated in one pass, errors said with where.

A refused body's error names the field it is in (a dict's key found again in a small body); a large body is
bounded before its parts are built into objects (:func:`parse_large_batch`). The bare ``NaN``/``Infinity``
tokens Python's json module writes are spelled as the protocol's strings where the decoder stops at them, and
the body goes on down the same path (no second parser that would build a hostile body whole); a body nested
deeper than the decoder goes is refused like any other that is not a batch.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta

from ampwatch.contract.protocol import MAX_BATCH_EVENTS

from ._schema import Batch, Event, WireRankState, decode_hook

__all__ = ["BatchError", "parse_batch", "parse_large_batch", "LARGE_BODY_BYTES", "STATE_BYTES_PER_OPTIMIZER",
           "MAX_BARE_TOKENS"]


class BatchError(ValueError):
    """A body that is not a protocol v1 batch: ``malformed`` when it is not JSON; ``lines`` say what and where."""

    def __init__(self, lines: list[str], malformed: bool) -> None:
        super().__init__(lines[0])
        self.lines, self.malformed = lines, malformed


_DECODER = msgspec.json.Decoder(Batch, dec_hook=decode_hook)
_EXPLAINED_UP_TO = 65_536  # bytes: a refused body this small is read twice to name the dict key an error is in

LARGE_BODY_BYTES = 65_536
"""Bodies larger than this (a batch is about 1 KiB, 16 optimizers without events about 6 KiB) are parsed by
:func:`parse_large_batch`, which the collector runs in a worker thread."""

STATE_BYTES_PER_OPTIMIZER = 2048
"""The most bytes of ``state`` a large body may hold per optimizer its collector allows (an optimizer's
counters take about 300), checked before the state is built into objects."""

MAX_BARE_TOKENS = 16
"""Bare ``NaN``/``Infinity``/``-Infinity`` tokens one body may hold (a batch has 4 scale values besides its
``scale_change`` events'; the protocol writes them as strings). Each costs the decoder one more pass over the
body, so a body of many would cost many times what any other does."""
_STOPPED_AT = re.compile(r"\(byte (\d+)\)$")  # where msgspec's DecodeError says it stopped
_VALUE_BEFORE = frozenset(b":,[")  # what may come before a value in JSON (a "," also before an object's key)
_NESTED_TOO_DEEP = "nested deeper than this collector reads (about 1,000 levels); a protocol v1 batch nests 5 at most"
_Decoded = TypeVar("_Decoded")

# The large path's first pass: the batch with its events left as raw JSON, one slice each, and its state as one.
_PARTS = msgspec.defstruct("_BatchParts", [
    (f.name, {"state": msgspec.Raw, "events": Annotated[list[msgspec.Raw], Meta(max_length=MAX_BATCH_EVENTS)]}.get(
        f.name, f.type), msgspec.field(default=f.default) if f.default_factory is msgspec.NODEFAULT else
     msgspec.field(default_factory=f.default_factory)) for f in msgspec.structs.fields(Batch)], frozen=True)
# Any: a struct made at run time has no fields to a type checker.
_PARTS_DECODER: msgspec.json.Decoder[Any] = msgspec.json.Decoder(_PARTS, dec_hook=decode_hook)
_STATE_DECODER = msgspec.json.Decoder(WireRankState, dec_hook=decode_hook)
_EVENT_DECODER = msgspec.json.Decoder(Event, dec_hook=decode_hook)


def parse_batch(body: bytes | str) -> Batch:
    """Parse and validate a raw request body in one pass (raises :class:`BatchError`)."""
    batch, _ = _decode(_DECODER.decode, body.encode() if isinstance(body, str) else body, "", explain=True)
    return batch


def parse_large_batch(body: bytes, max_optimizers: int) -> Batch:
    """Parse and validate a large body (raises :class:`BatchError`), bounding what it may hold before it is built
    into objects: a first pass keeps each event and the state as a slice of the body (unknown fields are
    skipped), so that more events than a batch may hold, or a state too large for ``max_optimizers``
    optimizers, are refused before any of them is built; then each part is decoded on its own. The same
    batches pass or fail as with :func:`parse_batch` but for that bound; run it in a worker thread: a
    thread switch may come between two parts (and between two passes over a body with bare tokens)."""
    parts, body = _decode(_PARTS_DECODER.decode, body, "", explain=False)
    limit = 1024 + STATE_BYTES_PER_OPTIMIZER * max_optimizers
    if len(parts.state) > limit:
        raise BatchError([f"state: {len(parts.state)} bytes, more than the {limit} that the counters of "
                          f"{max_optimizers} optimizers (this collector's --max-optimizers-per-rank) take"],
                         malformed=False)
    state, _ = _decode(_STATE_DECODER.decode, parts.state, "state.", explain=False)
    events = [_decode(_EVENT_DECODER.decode, raw, f"events[{i}].", explain=False)[0]
              for i, raw in enumerate(parts.events)]
    fields = {name: getattr(parts, name) for name in parts.__struct_fields__}
    try:
        return Batch(**dict(fields, state=state, events=events))
    except ValueError as exc:  # Batch.__post_init__: consistency across fields
        raise BatchError([f"body: {exc}"], malformed=False) from None


def _decode(decode: Callable[[Any], _Decoded], body: Any, where: str, *, explain: bool) -> tuple[_Decoded, Any]:
    """Return what ``decode`` makes of ``body`` (bytes, or a slice of them), and the body it read: with each bare
    token it stopped at spelled as the protocol's string, at most :data:`MAX_BARE_TOKENS` of them. Raise
    :class:`BatchError` with ``where`` before the error's path; ``explain``: name a dict's key (small bodies)."""
    for _ in range(MAX_BARE_TOKENS + 1):
        try:
            return decode(body), body
        except msgspec.ValidationError as exc:
            raise BatchError([where + _located(str(exc), body if explain else None)], malformed=False) from None
        except RecursionError:
            raise BatchError([f"{where.rstrip('.') or 'body'}: {_NESTED_TOO_DEEP}"], malformed=False) from None
        except msgspec.DecodeError as exc:
            spelled = _spelled(bytes(body), str(exc))
            if spelled is None:
                raise BatchError([str(exc)], malformed=True) from None
            body = spelled
    raise BatchError([f"more than {MAX_BARE_TOKENS} bare NaN/Infinity tokens: write non-finite values as the "
                      'strings "NaN", "Infinity" and "-Infinity", as the protocol does (docs/protocol.md)'],
                     malformed=True)


def _spelled(body: bytes, error: str) -> bytes | None:
    """Return ``body`` with the bare ``NaN``, ``Infinity`` or ``-Infinity`` value where the decoder stopped
    (``error`` says the byte) written as the protocol's string; None when it stopped at anything else."""
    stopped = _STOPPED_AT.search(error)
    if stopped is None:
        return None
    at = int(stopped.group(1))
    if body.startswith(b"NaN", at) and body[at - 1:at] != b"-":
        start, end = at, at + 3
    elif body.startswith(b"Infinity", at):
        start, end = (at - 1 if body[at - 1:at] == b"-" else at), at + 8
    else:
        return None
    before, after = body[:start].rstrip(), body[end:].lstrip()
    if (before and before[-1] not in _VALUE_BEFORE) or after.startswith(b":"):
        return None  # a key, or glued to something else: not a value Python's json module writes
    return b"%s\"%s\"%s" % (body[:start], body[start:end], body[end:])


def _located(message: str, body: Any = None) -> str:
    """``"<path>: <message>"`` from msgspec's ``"<message> - at `$.<path>`"``, a dict's key named where msgspec
    says ``[...]`` (found again in a small body; a large one keeps ``[...]``)."""
    text, _, where = message.rpartition(" - at `")
    if not text:
        return f"body: {message}"
    if "` in `" in where:  # an object's key: "<message> - at `key` in `$.path`"
        where = where.split("` in `", 1)[1]
        text += " (a key)"
    path = where.rstrip("`").removeprefix("$").lstrip(".")
    if "[...]" in path and body is not None and (not isinstance(body, (bytes, str)) or len(body) <= _EXPLAINED_UP_TO):
        path = _name_keys(body, path, message)
    return f"{path or 'body'}: {text}"


def _name_keys(body: Any, path: str, message: str) -> str:
    """Replace each ``[...]`` of ``path`` by the key whose entry alone makes the body fail with ``message``."""
    try:
        document = msgspec.json.decode(body) if isinstance(body, (bytes, str)) else body
    except RecursionError:
        return path
    head, _, rest = path.partition("[...]")
    node = document
    for part in filter(None, head.split(".")):
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, dict):
        return path
    entries = dict(node)
    try:
        for key in entries:
            node.clear()
            node[key] = entries[key]
            try:
                msgspec.convert(document, Batch, dec_hook=decode_hook)
            except RecursionError:
                continue
            except msgspec.ValidationError as exc:
                if str(exc) == message:
                    return f"{head}.{key}" + rest
    finally:
        node.clear()
        node.update(entries)
    return path
