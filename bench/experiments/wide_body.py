"""The wide-body attack's forms, each plain and with a bare NaN (issue 37), on an earlier commit beside this tree.

Each side starts a real collector on loopback with default settings and posts each body of
``ampwatch_support.wide_body`` (500,000 keys, 90,000 optimizers' counters, 2.7 million empty objects;
each also with the loss scale written as the bare ``NaN`` token) from 127.0.0.1, while a real job's
rank sends a batch every 20 ms from 127.0.0.2: the answer, its seconds (upload included), the
collector's peak memory growth and the rank's slowest answer meanwhile. Then the costliest body a
bare token can make: 16 of them (the cap) after 8 MiB of objects, each a pass of the decoder.
About 30 s per side.

    python -m bench.experiments.wide_body [--before efc5a5c] [--key wide_body_nan] [--out FILE]
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import httpx

from ampwatch_support import wide_body
from ampwatch_support.batches import make_batch
from bench import _servers
from bench._before_after import before_after_main

__all__ = ["main"]

KEY = "wide_body_nan"
JSON = {"Content-Type": "application/json"}


def _bodies() -> dict[str, bytes]:
    """The attack's forms, and 16 bare tokens after 8 MiB of objects (at the top level: the batch is valid)."""
    bodies = dict(wide_body.bodies_cache())
    base = json.dumps(make_batch(run="wide-body"))
    objects, tokens = ",".join(["{}"] * 2_780_000), ", ".join(["NaN"] * 16)
    bodies["2780k_objects_then_16_nan"] = base.replace(
        '"closed"', f'"bulk": [{objects}], "spare": [{tokens}], "closed"').encode()
    return bodies


def _side(path: str | None) -> dict:
    env = {"PYTHONPATH": os.pathsep.join(p for p in (path, os.environ.get("PYTHONPATH")) if p)} if path else None
    bodies = _bodies()
    wide_body._CACHE.clear()
    wide_body._CACHE.update(bodies)  # what play() posts
    with tempfile.TemporaryDirectory() as tmp, _servers.CollectorProcess(os.path.join(tmp, "w.db"), env=env) as c, \
            httpx.Client(base_url=c.url, timeout=120) as client, \
            httpx.Client(base_url=c.url, timeout=120,
                         transport=httpx.HTTPTransport(local_address="127.0.0.2")) as elsewhere:
        assert elsewhere.post("/v1/ingest", json=make_batch(run="real-job")).status_code == 200
        result = wide_body.play(
            lambda body: client.post("/v1/ingest", content=body, headers=JSON).status_code, c.proc.pid,
            lambda: elsewhere.post("/v1/ingest", json=make_batch(run="real-job", seq=int(time.time() * 1e3))
                                   ).status_code)
    return result


def main(argv: list[str] | None = None) -> dict:
    return before_after_main(argv, __doc__.splitlines()[0], "efc5a5c", "the one before issue 37's collector slice",
                             KEY, _side, module="experiments.wide_body")


if __name__ == "__main__":
    main()
