"""Read a request body into a :class:`~._schema.Batch`: decoded and validated in one pass, errors said with where.

A refused body's error names the field it is in (a dict's key found again in a small body); a large body is
bounded before its parts are built into objects (:func:`parse_large_batch`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Union

import msgspec
from msgspec import Meta

from ampwatch.contract.protocol import MAX_BATCH_EVENTS

from ._schema import Batch, Event, WireRankState, decode_hook

__all__ = ["BatchError", "parse_batch", "parse_large_batch", "LARGE_BODY_BYTES", "STATE_BYTES_PER_OPTIMIZER"]


class BatchError(ValueError):
    """A body that is not a protocol v1 batch: ``malformed`` when it is not JSON; ``lines`` say what and where."""

    def __init__(self, lines: list[str], malformed: bool) -> None:
        super().__init__(lines[0])
        self.lines, self.malformed = lines, malformed


_DECODER = msgspec.json.Decoder(Batch, dec_hook=decode_hook)
_BARE_NONFINITE = (b"NaN", b"Infinity")
_EXPLAINED_UP_TO = 65_536  # bytes: a refused body this small is read twice to name the dict key an error is in

LARGE_BODY_BYTES = 65_536
"""Bodies larger than this (a batch is about 1 KiB, 16 optimizers without events about 6 KiB) are parsed by
:func:`parse_large_batch`, which the collector runs in a worker thread."""

STATE_BYTES_PER_OPTIMIZER = 2048
"""The most bytes of ``state`` a large body may hold per optimizer its collector allows (an optimizer's
counters take about 300), checked before the state is built into objects."""

# The large path's first pass: the batch with its events left as raw JSON, one slice each, and its state as one.
_PARTS = msgspec.defstruct("_BatchParts", [
    (f.name, {"state": msgspec.Raw, "events": Annotated[list[msgspec.Raw], Meta(max_length=MAX_BATCH_EVENTS)]}.get(
        f.name, f.type), msgspec.field(default=f.default) if f.default_factory is msgspec.NODEFAULT else
     msgspec.field(default_factory=f.default_factory)) for f in msgspec.structs.fields(Batch)], frozen=True)
_PARTS_DECODER = msgspec.json.Decoder(_PARTS, dec_hook=decode_hook)
_STATE_DECODER = msgspec.json.Decoder(WireRankState, dec_hook=decode_hook)
_EVENT_DECODER = msgspec.json.Decoder(Event, dec_hook=decode_hook)


def parse_batch(body: Union[bytes, str]) -> Batch:
    """Parse and validate a raw request body in one pass (raises :class:`BatchError`)."""
    try:
        return _DECODER.decode(body)
    except msgspec.ValidationError as exc:
        raise BatchError([_located(str(exc), body)], malformed=False) from None
    except msgspec.DecodeError as exc:
        raw = body.encode() if isinstance(body, str) else body
        if any(token in raw for token in _BARE_NONFINITE):
            return _parse_python_tokens(raw)
        raise BatchError([str(exc)], malformed=True) from None


def parse_large_batch(body: bytes, max_optimizers: int) -> Batch:
    """Parse and validate a large body (raises :class:`BatchError`), bounding what it may hold before it is built
    into objects: a first pass keeps each event and the state as a slice of the body (unknown fields are
    skipped), so that more events than a batch may hold, or a state too large for ``max_optimizers``
    optimizers, are refused before any of them is built; then each part is decoded on its own. The same
    batches pass or fail as with :func:`parse_batch` but for that bound; run it in a worker thread: a
    thread switch may come between two parts."""
    try:
        parts = _PARTS_DECODER.decode(body)
    except msgspec.ValidationError as exc:
        raise BatchError([_located(str(exc))], malformed=False) from None
    except msgspec.DecodeError:
        return parse_batch(body)  # not JSON, or Python's NaN tokens: said as parse_batch says it
    limit = 1024 + STATE_BYTES_PER_OPTIMIZER * max_optimizers
    if len(parts.state) > limit:
        raise BatchError([f"state: {len(parts.state)} bytes, more than the {limit} that the counters of "
                          f"{max_optimizers} optimizers (this collector's --max-optimizers-per-rank) take"],
                         malformed=False)
    try:
        state = _STATE_DECODER.decode(parts.state)
    except msgspec.ValidationError as exc:
        raise BatchError(["state." + _located(str(exc))], malformed=False) from None
    events = []
    for i, raw in enumerate(parts.events):
        try:
            events.append(_EVENT_DECODER.decode(raw))
        except msgspec.ValidationError as exc:
            raise BatchError([f"events[{i}]." + _located(str(exc))], malformed=False) from None
    fields = {name: getattr(parts, name) for name in parts.__struct_fields__}
    try:
        return Batch(**dict(fields, state=state, events=events))
    except ValueError as exc:  # Batch.__post_init__: consistency across fields
        raise BatchError([f"body: {exc}"], malformed=False) from None


def _parse_python_tokens(body: bytes) -> Batch:
    """A body with the bare NaN/Infinity tokens Python's json module writes (not JSON, but what a Python client
    sends by default): read by that module, then validated as any other."""
    try:
        document = json.loads(body)
    except ValueError as exc:
        raise BatchError([str(exc)], malformed=True) from None
    try:
        return msgspec.convert(document, Batch, dec_hook=decode_hook)
    except msgspec.ValidationError as exc:
        raise BatchError([_located(str(exc), document)], malformed=False) from None


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
    except msgspec.DecodeError:
        document = json.loads(body)
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
            except msgspec.ValidationError as exc:
                if str(exc) == message:
                    return f"{head}.{key}" + rest
    finally:
        node.clear()
        node.update(entries)
    return path
