"""The integrations record each iteration's sample ids without a call (issue 39): Lightning, the Trainer, Accelerate.

Each job trains on a shuffled map-style dataset whose items carry their own index, and sample 13's input is
inf. The model notes the indices it trains on (the ground truth, in training order); every skip (or, without a
scaler, poisoned step) the collector receives must name exactly the indices of its iteration, although each
framework fetches batches ahead of the one it trains on.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from ampwatch.server._batch_parse import parse_batch
from ampwatch_support.recording_collector import RecordingCollector

BAD = 13
pytestmark = pytest.mark.filterwarnings("ignore")  # the frameworks' advice on workers, loggers, precision


class Indexed(torch.utils.data.Dataset):
    """24 examples of 8 values, each with its own index; example 13 holds an inf."""

    def __init__(self, as_dict: bool = False) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(24, 8, generator=generator)
        self.y = torch.randn(24, generator=generator)
        self.x[BAD, 0] = float("inf")
        self.as_dict = as_dict

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        if self.as_dict:
            return {"x": self.x[i], "labels": self.y[i], "idx": torch.tensor(i)}
        return self.x[i], i


@pytest.fixture
def collector(monkeypatch):
    for var in ("AMPWATCH_URL", "AMPWATCH_RUN", "AMPWATCH_DISABLED", "AMPWATCH_SPOOL_DIR"):
        monkeypatch.delenv(var, raising=False)
    with RecordingCollector() as server:
        yield server


def _events(server: RecordingCollector, kind: str) -> list[dict]:
    for body in server.bodies:
        parse_batch(body)
    return [e for body in server.bodies for e in json.loads(body)["events"] if e["kind"] == kind]


def _iterations_with_bad(trained: list[list[int]]) -> dict[int, list[int]]:
    return {i: ids for i, ids in enumerate(trained) if BAD in ids}


def test_lightning_names_each_skips_batch_by_the_samplers_indices(collector):
    pytest.importorskip("lightning")
    import lightning.pytorch as pl

    from ampwatch.agent.lightning import AmpWatchCallback
    from ampwatch_support.lightning_job import fp16_plugin

    trained: list[list[int]] = []

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            x, index = batch
            trained.append(index.tolist())
            return self.layer(x).float().pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(Indexed(), batch_size=4, shuffle=True)
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         plugins=[fp16_plugin(init_scale=1024.0)],
                         callbacks=[AmpWatchCallback(collector=collector.url, run="lightning-ids", push_interval=0.05)])
    trainer.fit(Module(), loader)
    skips = {e["iteration"]: e["samples"]["ids"] for e in _events(collector, "skip")}
    assert skips == _iterations_with_bad(trained) and len(skips) == 2  # one per epoch, Lightning fetching ahead


def test_the_trainer_names_each_update_by_its_micro_batches_indices(collector, tmp_path):
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    from ampwatch.agent.transformers import AmpWatchCallback
    from ampwatch_support.hf_job import CpuFp16Trainer, Tiny

    trained: list[list[int]] = []

    class Noting(Tiny):
        def forward(self, x, labels=None, idx=None):
            trained.append(idx.tolist())
            return super().forward(x, labels)

    torch.manual_seed(0)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=3, gradient_accumulation_steps=2,
                             num_train_epochs=2, fp16=True, use_cpu=True, report_to=[], save_strategy="no",
                             logging_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0)
    trainer = CpuFp16Trainer(model=Noting(), args=args, train_dataset=Indexed(as_dict=True),
                             callbacks=[AmpWatchCallback(collector=collector.url, run="trainer-ids",
                                                         push_interval=0.05)])
    trainer.train()
    updates = [trained[k] + trained[k + 1] for k in range(0, len(trained), 2)]
    skips = {e["iteration"]: e["samples"]["ids"] for e in _events(collector, "skip")}
    assert skips == _iterations_with_bad(updates) and len(skips) == 2


def test_accelerate_names_each_iteration_by_the_micro_batches_its_loop_received(collector, fresh_state, caplog):
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from ampwatch.agent import accelerate as ampwatch
    from ampwatch_support.framework_truth import gpu_like_fp16

    accelerator = gpu_like_fp16(Accelerator(mixed_precision="fp16", cpu=True, gradient_accumulation_steps=2),
                                init_scale=1024.0)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(Indexed(), batch_size=3, shuffle=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    w = ampwatch.watch(accelerator, opt, model=model, loader=loader, collector=collector.url, run="accelerate-ids",
                       push_interval=0.05)
    received: list[list[int]] = []
    for _epoch in range(2):
        for x, index in loader:
            received.append(index.tolist())
            with accelerator.accumulate(model):
                accelerator.backward(model(x).float().pow(2).mean())
                opt.step()
                opt.zero_grad()
    w.close()
    updates = [received[k] + received[k + 1] for k in range(0, len(received), 2)]
    skips = {e["iteration"]: e["samples"]["ids"] for e in _events(collector, "skip")}
    assert skips == _iterations_with_bad(updates) and len(skips) == 2


@pytest.fixture
def fresh_state():
    pytest.importorskip("accelerate")
    from ampwatch_support.framework_truth import reset_accelerate_state

    reset_accelerate_state()
    yield
    reset_accelerate_state()


def test_a_dispatching_accelerate_loader_is_refused_with_what_to_do_instead(collector, fresh_state):
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    from ampwatch.agent import accelerate as ampwatch

    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt, loader = accelerator.prepare(model, opt, torch.utils.data.DataLoader(Indexed(), batch_size=3))
    logging.getLogger("ampwatch.agent").setLevel(logging.WARNING)
    with pytest.raises(ValueError, match="watch.batch"):
        ampwatch.watch(accelerator, opt, loader=loader, collector=collector.url, run="dispatch")
