"""The integrations pass each micro-batch's loss to the watch without a call (issue 39, "Where it began").

bf16 autocast on CPU, no GradScaler: the agent knows whether a poisoned step's loss was finite only from the loss
the integration hands ``watch.loss``. Two poisons, each at batch 1 of a real fit or loop, each against its
unwatched twin (weights bit for bit):

- ``input``: the batch's input holds an inf, so the loss is not finite: ``stage`` forward, the probes armed; the
  poisoned step's NaN weights make the next loss NaN too, and the probes name the first module they reach;
- ``gradient``: :class:`~ampwatch_support.began_job.InfGradient` makes ``first``'s output gradient inf in backward:
  the loss was finite, ``stage`` backward, naming ``first``; the next steps are the forward case.

With a scaler the integrations leave the loss to the watched ``scaler.scale()`` (noted once); the Trainer's callback
passes none, and the ``training_step`` override docs/integrations.md gives does.
"""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from torch import nn

from ampwatch.server._batch_parse import parse_batch
from ampwatch_support.began_job import InfGradient
from ampwatch_support.framework_truth import INF, bits, same_bits
from ampwatch_support.recording_collector import RecordingCollector

pytestmark = pytest.mark.filterwarnings("ignore")  # the frameworks' advice on workers, loggers, precision

AT = 1  # the poisoned batch
ARMED = {"loss_finite": False, "stage": "forward", "probe": "armed"}
FOUND = {**ARMED, "probe": "found", "module_type": "Linear"}
BACKWARD = {"loss_finite": True, "stage": "backward", "module_type": "Linear"}
STARTS = {"input": [(1, ARMED), (2, FOUND), (4, ARMED)], "gradient": [(1, BACKWARD), (2, ARMED), (4, FOUND)]}
"""(iteration, began) of the poisoned steps reported (a streak's 1st, 2nd and 4th), ``module`` and a backward start's
``param`` left out; once the probes have named a module they come off, and the next forward start arms them again."""


def expected(poison: str, first: str) -> list[tuple[int, dict]]:
    """:data:`STARTS` with ``first``'s path (as the watched model names it) where a module is named."""
    return [(i, {**began, "module": first} if "module_type" in began else began) for i, began in STARTS[poison]]


class Net(nn.Module):
    """``last(relu(first(x)))``, poisoned on cue (``poison``: "input" or "gradient") at batch :data:`AT`."""

    def __init__(self, poison: str) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(8, 8), nn.Linear(8, 4)
        self.poison = poison

    def forward(self, x: torch.Tensor, batch: int) -> torch.Tensor:
        if batch == AT and self.poison == "input":
            x = x.clone()
            x[0, 0] = INF
        h = self.first(x)
        if batch == AT and self.poison == "gradient":
            h = InfGradient.apply(h)
        return self.last(torch.relu(h)).float().pow(2).mean()


def _inputs() -> list[torch.Tensor]:
    return list(torch.randn(5, 4, 8, generator=torch.Generator().manual_seed(0)))


def _began(server: RecordingCollector) -> list[tuple[int, dict]]:
    """(iteration, began) of each poisoned step the collector received, the backward start's ``param`` left out."""
    for body in server.bodies:
        parse_batch(body)
    events = [e for body in server.bodies for e in json.loads(body)["events"] if e["kind"] == "poisoned_step"]
    seen = [(e["iteration"], dict(e["began"])) for e in events]
    for _, began in seen:
        if began.get("stage") == "backward":
            assert began.pop("param").rsplit(".", 1)[0] == began["module"]
    return seen


@pytest.fixture
def collector(monkeypatch):
    for var in ("AMPWATCH_URL", "AMPWATCH_RUN", "AMPWATCH_DISABLED", "AMPWATCH_SPOOL_DIR"):
        monkeypatch.delenv(var, raising=False)
    with RecordingCollector() as server:
        yield server


def _lightning_fit(poison: str, callbacks: list, plugins=None, precision="bf16-mixed") -> nn.Module:
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net(poison)

        def training_step(self, x, batch_idx):
            return self.net(x, batch_idx)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    torch.manual_seed(0)
    module = Module()
    pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
               precision=None if plugins else precision, plugins=plugins, callbacks=callbacks,
               ).fit(module, torch.utils.data.DataLoader(_inputs(), batch_size=None))
    return module.net


@pytest.mark.parametrize("poison", ["input", "gradient"])
def test_lightning_in_bf16_passes_each_loss_so_began_tells_a_forward_start_from_a_backward_one(collector, poison):
    pytest.importorskip("lightning")
    from ampwatch.agent.lightning import AmpWatchCallback

    callback = AmpWatchCallback(collector=collector.url, run=f"lightning-{poison}", push_interval=0.05)
    watched = _lightning_fit(poison, [callback])
    assert _began(collector) == expected(poison, "net.first")
    assert same_bits(bits(watched.parameters()), bits(_lightning_fit(poison, []).parameters()))


def test_lightning_with_a_scaler_leaves_the_loss_to_scaler_scale_so_it_is_noted_once(collector):
    pytest.importorskip("lightning")
    from lightning.pytorch.callbacks import Callback

    from ampwatch.agent.lightning import AmpWatchCallback
    from ampwatch_support.lightning_job import fp16_plugin

    callback = AmpWatchCallback(collector=collector.url, run="lightning-scaled", push_interval=0.05)
    noted: list[int] = []

    class Count(Callback):  # after ours: the losses noted for the iteration, right after its one backward
        def on_after_backward(self, trainer, pl_module):
            noted.append(len(callback.watch._recorder.began.losses.open))

    _lightning_fit("none", [callback, Count()], plugins=[fp16_plugin(init_scale=1024.0)])
    assert noted == [1] * len(_inputs())


def _accelerate_run(poison: str, watched: RecordingCollector | None) -> tuple[nn.Module, dict, dict]:
    """The loop Accelerate documents, bf16 on CPU; returns the model and ``vars(accelerator)`` inside and after."""
    from accelerate import Accelerator

    from ampwatch.agent import accelerate as ampwatch
    from ampwatch_support.framework_truth import reset_accelerate_state

    reset_accelerate_state()
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    torch.manual_seed(0)
    net = Net(poison)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    model, opt = accelerator.prepare(net, opt)
    w = None
    if watched is not None:
        w = ampwatch.watch(accelerator, opt, model=model, collector=watched.url, run=f"accelerate-{poison}",
                           push_interval=0.05)
    inside = dict(vars(accelerator))
    pickled = pickle.dumps(accelerator)  # as a job may, while watched: nothing of ampwatch goes with it
    assert b"ampwatch" not in pickled
    twin = pickle.loads(pickled)
    assert twin.backward.__self__ is twin  # its own method, never the original accelerator's
    for batch, x in enumerate(_inputs()):
        with accelerator.autocast():
            loss = model(x, batch)
        if batch == 0:  # its arguments and exceptions are Accelerate's own, watched or not
            assert accelerator.backward(loss, retain_graph=True) is None
            torch.autograd.grad(loss, list(net.parameters()))  # the graph kept: retain_graph reached backward
            with pytest.raises(RuntimeError, match="does not require grad"):
                accelerator.backward(torch.ones(()))
        else:
            assert accelerator.backward(loss) is None
        opt.step()
        opt.zero_grad()
    if w is not None:
        w.close()
    after = dict(vars(accelerator))
    reset_accelerate_state()
    return net, inside, after


@pytest.mark.parametrize("poison", ["input", "gradient"])
def test_accelerate_in_bf16_passes_each_backwards_loss_and_gives_the_accelerator_back_at_close(collector, poison):
    pytest.importorskip("accelerate")
    watched, inside, after = _accelerate_run(poison, collector)
    assert _began(collector) == expected(poison, "first")
    assert "backward" in inside and "backward" not in after  # its own method again, nothing of ours left on it
    plain, untouched, _ = _accelerate_run(poison, None)
    assert "backward" not in untouched
    assert same_bits(bits(watched.parameters()), bits(plain.parameters()))


def test_the_trainer_passes_no_loss_but_the_documented_training_step_override_does(collector, tmp_path):
    """No Trainer callback sees the loss, the Trainer or its Accelerator (docs/integrations.md): a bf16 Trainer's
    poisoned step says nothing of its loss, until ``training_step`` hands it to ``callback.watch.loss``."""
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    from ampwatch.agent.transformers import AmpWatchCallback
    from ampwatch_support.hf_job import Examples, Tiny

    class Passing(Trainer):  # the override docs/integrations.md gives
        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            callback.watch.loss(loss)
            return loss

    firsts = []
    for kind, name in ((Trainer, "plain"), (Passing, "passing")):
        callback = AmpWatchCallback(collector=collector.url, run=f"trainer-{name}", push_interval=0.05)
        args = TrainingArguments(output_dir=str(tmp_path / name), per_device_train_batch_size=2, max_steps=3,
                                 bf16=True, use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
                                 disable_tqdm=True, seed=0, dataloader_num_workers=0)
        torch.manual_seed(0)
        kind(model=Tiny(), args=args, train_dataset=Examples(6, poisoned=(0, 1, 2, 3, 4, 5)),
             callbacks=[callback]).train()
        firsts.append(_began(collector)[0])
        collector.bodies.clear()
    assert firsts == [(0, {"loss_finite": None}), (0, ARMED)]
