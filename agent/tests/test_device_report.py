"""The batch's ``device``: each rank names the accelerator it trains on until the collector has accepted it."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from ampwatch import agent
from ampwatch.agent._device_info import device_info
from ampwatch.server._batch_parse import parse_batch
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.patience import wait_until
from ampwatch_support.recording_collector import RecordingCollector


def _skip(model, scaler, opt) -> None:
    x = torch.randn(4, 8)
    x[0, 0] = float("inf")
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


def test_the_device_goes_in_every_batch_retry_and_refused_one_until_one_is_accepted_and_never_after(no_collector):
    with RecordingCollector() as server:
        server.status = 503  # the collector cannot take batches yet: the same batch is sent again
        model = torch.nn.Linear(8, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu")
        w = agent.watch(scaler, opt, model=model, collector=server.url, run="device", push_interval=0.05)
        assert server.wait_for(lambda s: len(s.received) >= 3), "the agent kept retrying"
        server.status = 422  # refused for good: dropped, not accepted, so the next batch carries the device again
        _skip(model, scaler, opt)  # news: a new batch while the collector refuses them
        assert server.wait_for(lambda s: any(body["seq"] >= 2 for body in s.received))
        server.status = 200
        _skip(model, scaler, opt)
        assert server.wait_for(lambda s: len(s.acked) >= 1)
        _skip(model, scaler, opt)  # after the acceptance: more batches
        w.close()
        bodies, accepted = list(server.bodies), server.acked[0]["seq"]
    received = [json.loads(body) for body in bodies]
    until = [body for body in received if body["seq"] <= accepted]
    after = [body for body in received if body["seq"] > accepted]
    assert len(until) >= 4 and {body["seq"] for body in until} >= {1, 2}  # retried, refused, then one taken
    assert all(body["device"] == {"type": "cpu"} for body in until)  # each retry carried it
    assert after and not any("device" in body for body in after)
    assert after[-1]["closed"]
    for body in bodies:
        parse_batch(body)


@pytest.mark.slow
def test_the_device_reaches_the_collector_through_the_node_relay(tmp_path, monkeypatch, no_collector):
    monkeypatch.setenv("AMPWATCH_RELAY", "1")
    monkeypatch.setenv("AMPWATCH_RELAY_DIR", str(tmp_path / "relay"))
    with CollectorProcess(str(tmp_path / "ampwatch.db")) as collector:
        model = torch.nn.Linear(8, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        w = agent.watch(torch.amp.GradScaler("cpu"), opt, model=model, collector=collector.url, run="relayed",
                        push_interval=0.05)
        sender = w._sender
        wait_until(lambda: sender._device_accepted, what="a batch carrying the device accepted through the relay")
        assert any(t.name == "ampwatch-relay" for t in threading.enumerate())  # this rank serves the relay
        assert sender._node is not None and sender._device_through >= 1
        w.close()
        assert sender.delivery["agent_errors"] == 0 and sender.rejected_batches == 0


def test_a_device_is_named_by_its_type_and_on_a_gpu_by_index_and_uuid():
    assert device_info(torch.device("cpu")) == {"type": "cpu"}
    assert device_info(torch.device("meta")) == {"type": "meta"}
    assert device_info(None) is None
    if not torch.cuda.is_available():
        pytest.skip("no GPU here: a GPU's index, UUID and PCI bus id are read by bench.gpu's run")
    info = device_info(torch.device("cuda", 0))
    assert info["type"] == "cuda" and info["index"] == 0 and info["uuid"].startswith(("GPU-", "MIG-"))
