"""Bodies at and past the ingest path's bounds, against one real collector process: nesting deeper than the decoder
reads, a state larger than the collector's optimizers take, and bare ``NaN`` tokens past their cap.

Each is refused for good (``"retry": false``: an agent drops it rather than retrying it forever) with a
message that says why, in a protocol v1 request as in one rank's part of a v2 node batch, and the
collector logs no traceback for it.
"""

from __future__ import annotations

import json

import httpx
import pytest

from ampwatch.contract.node_batch import encode_node_batch
from ampwatch.server._batch_parse import LARGE_BODY_BYTES, MAX_BARE_TOKENS, STATE_BYTES_PER_OPTIMIZER
from ampwatch.server._config import ServerConfig
from ampwatch_support.batches import APPLIED, make_batch
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.exposition import value

pytestmark = pytest.mark.timeout(120)

JSON = {"Content-Type": "application/json"}
DEPTH = 1000  # msgspec's RecursionError began here, inside an object: a 500 with "retry": true


@pytest.fixture(scope="module")
def collector(tmp_path_factory):
    root = tmp_path_factory.mktemp("bounds")
    with CollectorProcess(str(root / "ampwatch.db")) as running:
        yield running


@pytest.fixture
def client(collector):
    with httpx.Client(base_url=collector.url, timeout=30) as c:
        yield c


def _post(client: httpx.Client, body: bytes) -> httpx.Response:
    return client.post("/v1/ingest", content=body, headers=JSON)


def _deep(run: str, where: str) -> bytes:
    """A valid batch with ``DEPTH`` levels of nesting in a field no protocol version knows, at ``where``."""
    nested = '{"a":' * DEPTH + "1" + "}" * DEPTH
    body = json.dumps(make_batch(run=run, events=[{"id": 1, "kind": "warning", "time": 1.0, "iteration": 0,
                                                   "code": "c", "message": "m"}]))
    anchor = {"top": '"run"', "state": '"iteration"', "event": '"code"'}[where]
    return body.replace(anchor, f'"deep": {nested}, {anchor}', 1).encode()


@pytest.mark.parametrize("where", ["top", "state", "event"])
def test_a_body_nested_a_thousand_deep_inside_an_object_is_refused_for_good_without_a_traceback(collector, client,
                                                                                                where):
    log_before = open(collector.log_path).read()
    small = _post(client, _deep(f"deep-{where}", where))
    large = _post(client, _deep(f"deep-large-{where}", where).replace(b'"deep"', b'"pad": "' + b"x" * LARGE_BODY_BYTES
                                                                      + b'", "deep"', 1))
    for answer in (small, large):
        assert answer.status_code == 422, answer.text
        assert answer.json()["retry"] is False and answer.json()["error"] == "schema"
        assert "nested deeper than this collector reads" in answer.json()["detail"][0]
    # One rank's part of a node batch is refused on its own; the other rank's is applied.
    node = _post(client, encode_node_batch([json.dumps(make_batch(run=f"deep-node-{where}")).encode(),
                                            _deep(f"deep-node-{where}", where).replace(b'"rank": 0', b'"rank": 1')]))
    assert node.status_code == 200, node.text
    applied, refused = node.json()["results"]
    assert applied["status"] == 200 and applied["applied"] is True
    assert refused["status"] == 422 and refused["retry"] is False, refused
    assert "nested deeper" in refused["detail"][0]
    text = client.get("/metrics").text
    assert value(text, "ampwatch_collector_ingest_requests_total", code="500") is None
    assert open(collector.log_path).read() == log_before, "a refused body must not log a traceback"


def _with_state_of(size: int, run: str) -> bytes:
    """A valid batch over ``LARGE_BODY_BYTES`` (the large path) whose ``state`` is ``size`` bytes, padded with a
    field no protocol version knows."""
    batch = make_batch(run=run)
    state = json.dumps(dict(batch["state"], padding=""))
    state = state.replace('"padding": ""', '"padding": "' + "x" * (size - len(state)) + '"')
    assert len(state) == size
    body = json.dumps(dict(batch, state="STATE", bulk="y" * LARGE_BODY_BYTES)).replace('"STATE"', state)
    assert len(body) > LARGE_BODY_BYTES
    return body.encode()


def test_a_state_one_byte_over_what_the_collectors_optimizers_take_is_refused_and_one_at_it_is_applied(client):
    optimizers = ServerConfig().max_optimizers_per_rank  # the collector runs with the defaults
    limit = 1024 + STATE_BYTES_PER_OPTIMIZER * optimizers
    at = _post(client, _with_state_of(limit, "state-at-limit"))
    assert at.status_code == 200 and at.json() == APPLIED, at.text
    over = _post(client, _with_state_of(limit + 1, "state-over-limit"))
    assert over.status_code == 422 and over.json()["retry"] is False, over.text
    assert over.json()["detail"] == [f"state: {limit + 1} bytes, more than the {limit} that the counters of "
                                     f"{optimizers} optimizers (this collector's --max-optimizers-per-rank) take"]
    assert client.get("/v1/runs/state-over-limit").status_code == 404


def test_bare_nan_tokens_are_read_as_the_protocols_strings_up_to_their_cap(client):
    tokens = ", ".join(["NaN"] * MAX_BARE_TOKENS)
    batch = json.dumps(make_batch(run="bare-tokens", loss_scale=float("nan")))  # json.dumps writes NaN bare
    assert "NaN" in batch
    within = _post(client, batch.replace('"closed"', f'"spare": [{tokens[5:]}], "closed"').encode())
    assert within.json() == APPLIED, within.text
    assert client.get("/v1/runs/bare-tokens").json()["ranks"][0]["loss_scale"] == "NaN"
    over = _post(client, batch.replace('"run": "bare-tokens"', '"run": "bare-tokens-over"')
                 .replace('"closed"', f'"spare": [{tokens}], "closed"').encode())
    assert over.status_code == 400 and over.json()["retry"] is False, over.text
    assert f"more than {MAX_BARE_TOKENS} bare NaN/Infinity tokens" in over.json()["message"]
