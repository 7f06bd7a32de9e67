"""The framework integrations import their framework only when imported, and say what to install when it is missing."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from ampwatch.agent._frameworks import attach

INTEGRATIONS = [  # (module, what it imports, the extra that installs it)
    ("ampwatch.agent.lightning", "lightning.pytorch", "lightning"),
    ("ampwatch.agent.pytorch_lightning", "pytorch_lightning", "pytorch-lightning"),
    ("ampwatch.agent.transformers", "transformers", "transformers"),
    ("ampwatch.agent.accelerate", "accelerate", "accelerate"),
]


@pytest.mark.parametrize("module, framework, extra", INTEGRATIONS)
def test_a_missing_framework_says_which_extra_to_install(monkeypatch, module, framework, extra):
    monkeypatch.delitem(sys.modules, module, raising=False)
    for name in {framework, framework.split(".")[0]}:
        monkeypatch.setitem(sys.modules, name, None)  # what Python does for a package that is not installed
    with pytest.raises(ImportError) as raised:
        __import__(module)
    message = str(raised.value)
    assert module in message and f'pip install "ampwatch-agent[{extra}]"' in message, message
    assert repr(framework.split(".")[0]) in message


def test_importing_the_agent_imports_no_framework():
    frameworks = ("lightning", "pytorch_lightning", "transformers", "accelerate")
    code = f"import sys, ampwatch.agent; print([m for m in {frameworks!r} if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# ----- the piece all three share: naming optimizers, pairing schedulers ---------------------------

class Wrapper:
    """Stands in for a framework's optimizer or scheduler wrapper (it only exposes what it wraps)."""

    def __init__(self, **inner):
        self.__dict__.update(inner)

    def step(self):  # a wrapper's step steps what it wraps, as Accelerate's do
        (self.scheduler if "scheduler" in vars(self) else self.optimizer).step()


def parts(amp):
    model = amp.TwoPart()
    return model, torch.optim.SGD(model.a.parameters(), lr=0.1), torch.optim.SGD(model.b.parameters(), lr=0.1)


def test_optimizers_are_named_by_the_submodule_they_own(amp, no_collector):
    model, opt_a, opt_b = parts(amp)
    with attach(torch.amp.GradScaler("cpu"), [opt_a, opt_b], module=model, run="t") as w:
        assert set(w.snapshot()["state"]["optimizers"]) == {"a", "b"}


def test_sequential_positions_and_shared_submodules_fall_back_to_class_names(amp, no_collector):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    second = torch.optim.Adam(model[1].parameters())
    with attach(torch.amp.GradScaler("cpu"), [first, second], module=model, run="t") as w:
        assert set(w.snapshot()["state"]["optimizers"]) == {"SGD", "Adam"}
    model, _, _ = parts(amp)
    bias = torch.optim.SGD([model.a.bias], lr=0.1)
    rest = torch.optim.Adam([model.a.weight, *model.b.parameters()])  # owns parts of both: no one submodule
    with attach(torch.amp.GradScaler("cpu"), [bias, rest], module=model, run="t") as w:
        assert set(w.snapshot()["state"]["optimizers"]) == {"SGD", "Adam"}


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")  # b skipped: torch says so
def test_schedulers_pair_with_the_optimizer_they_drive_through_wrappers(amp, no_collector, events):
    model, opt_a, opt_b = parts(amp)
    wrapped_b = Wrapper(optimizer=opt_b)
    sched_a = torch.optim.lr_scheduler.StepLR(opt_a, 1)
    sched_b = Wrapper(scheduler=torch.optim.lr_scheduler.StepLR(opt_b, 1))  # like AcceleratedScheduler
    per_epoch = torch.optim.lr_scheduler.ExponentialLR(opt_a, 0.9)
    scaler = torch.amp.GradScaler("cpu")
    with attach(scaler, [opt_a, wrapped_b], module=model, run="t",
                schedulers=[sched_b, {"scheduler": per_epoch, "interval": "epoch"}, sched_a]) as w:
        assert "step" in vars(sched_a) and "step" in vars(sched_b.scheduler) and "step" not in vars(sched_b)
        assert "step" not in vars(per_epoch)
        amp.iteration(model, scaler, [opt_a, opt_b], torch.randn(4, 8),
                      after_backward=lambda: amp.poison_grad(model.b.weight))
        sched_b.step()
        sched_a.step()
        per_epoch.step()
        counters = w.snapshot()["state"]["optimizers"]
    assert counters["b"]["scheduler_steps_after_skip"] == 1 and counters["a"]["scheduler_steps_after_skip"] == 0


def test_a_scheduler_of_an_unwatched_optimizer_is_left_alone_with_a_warning(amp, no_collector, caplog):
    model, opt_a, opt_b = parts(amp)
    other = torch.optim.lr_scheduler.StepLR(opt_b, 1)
    with caplog.at_level(logging.WARNING, logger="ampwatch.agent"):
        with attach(torch.amp.GradScaler("cpu"), [opt_a], schedulers=[other], run="t"):
            assert "step" not in vars(other)
    assert any("not watching the StepLR" in r.getMessage() for r in caplog.records)


def test_names_must_match_the_optimizers(amp, no_collector):
    model, opt_a, opt_b = parts(amp)
    with pytest.raises(ValueError, match="got 1 names for 2 optimizers"):
        attach(torch.amp.GradScaler("cpu"), [opt_a, opt_b], names=["x"])
    with pytest.raises(ValueError, match="each optimizer needs its own name"):
        attach(torch.amp.GradScaler("cpu"), [opt_a, opt_b], names=["x", "x"])
