"""A watch's life in real jobs: all-or-nothing attach, wrapper optimizers, forgotten close(), sweeps and exit."""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch

from ampwatch import agent
from ampwatch_support.patience import START_S, wait_until
from ampwatch_support.recording_collector import RecordingCollector

REPO = pathlib.Path(__file__).resolve().parents[2]


def small_job(amp):
    model = amp.TwoPart()
    return model, torch.optim.AdamW(model.parameters(), lr=0.01), torch.amp.GradScaler("cpu")


def untouched(scaler, *optimizers) -> bool:
    """The scaler and optimizers carry nothing of the agent, and the scaler still saves."""
    torch.save(scaler, io.BytesIO())
    return (not {"step", "update", "load_state_dict", "__getstate__"} & set(vars(scaler))
            and not any(o._optimizer_step_pre_hooks for o in optimizers))


# ----- all-or-nothing attach and wrapper optimizers (item 7) ----------------------------------------

class HalfMadeOptimizer(torch.optim.Optimizer):
    """A wrapper that subclasses Optimizer but never runs Optimizer.__init__, and exposes nothing."""

    def __init__(self, inner):
        self._inner = inner
        self.param_groups = inner.param_groups


def test_a_half_initialised_optimizer_is_refused_naming_what_to_pass_and_nothing_is_left_patched(amp, watching):
    model, opt, scaler = small_job(amp)
    with pytest.raises(TypeError, match="pass the torch.optim.Optimizer that actually steps"):
        watching(scaler, {"ok": torch.optim.SGD(model.a.parameters(), lr=0.1),
                          "bad": HalfMadeOptimizer(torch.optim.SGD(model.b.parameters(), lr=0.1))})
    assert untouched(scaler, opt)


def test_a_failure_part_way_through_attaching_leaves_scaler_optimizers_and_schedulers_untouched(amp, watching):
    class FrozenStepLR(torch.optim.lr_scheduler.StepLR):
        def __setattr__(self, name, value):
            if name == "state_dict":
                raise AttributeError("this scheduler's attributes are frozen")
            super().__setattr__(name, value)

    model, opt, scaler = small_job(amp)
    sched = FrozenStepLR(opt, 1)
    with pytest.raises(AttributeError, match="frozen"):
        watching(scaler, opt, schedulers=sched)
    assert untouched(scaler, opt)
    assert not {"step", "__getstate__"} & set(vars(sched))
    w = watching(scaler, opt)  # nothing is left claiming the scaler either
    amp.iteration(model, scaler, [opt], torch.randn(4, 8))
    assert w.stepped(opt) is True


def test_accelerates_wrapped_optimizer_is_unwrapped_and_its_skips_counted(amp, watching):
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    Accelerator(cpu=True)  # AcceleratedOptimizer reads the process-wide state this initialises
    model, opt, scaler = small_job(amp)
    wrapped = AcceleratedOptimizer(opt, device_placement=False, scaler=scaler)
    w = watching(scaler, wrapped, model=model)
    assert list(w.snapshot()["state"]["optimizers"]) == ["AdamW"]
    for poison in (True, False, False):
        wrapped.zero_grad()
        scaler.scale(amp.forward(model, torch.randn(4, 8))).backward()
        if poison:
            amp.poison_grad(model.a.weight)
        wrapped.step()  # runs scaler.step(opt) and scaler.update() itself
    counters = w.snapshot()["state"]["optimizers"]["AdamW"]
    assert (counters["skipped"], counters["steps"]) == (1, 2)
    assert w.stepped(wrapped) is True and w.stepped(opt) is True


# ----- forgotten close() (item 6) -------------------------------------------------------------------

def _sweep_trial(amp, watch_kwargs):
    """One trial of a sweep: build, watch (never closed), train, drop everything; return weak references."""
    model, opt, scaler = small_job(amp)
    w = agent.watch(scaler, opt, model=model, run="sweep", **watch_kwargs)
    amp.iteration(model, scaler, [opt], torch.randn(4, 8), after_backward=lambda: amp.poison_grad(model.a.weight))
    return weakref.ref(model.a.weight), weakref.ref(scaler), weakref.ref(w)


def collect_garbage() -> None:
    """Two passes: the first frees the scaler, whose finalizer then lets go of the rest for the second."""
    gc.collect()
    gc.collect()


@contextlib.contextmanager
def without_cyclic_gc():
    """Run the block with the cyclic garbage collector off: only reference counting frees anything."""
    # The first optimizer a process makes imports torch._dynamo, which keeps the frames that made it (and their
    # locals) until a GC pass: made here, that one-off of torch's stays out of what the block measures.
    torch.optim.AdamW(torch.nn.Linear(1, 1).parameters())
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def test_unclosed_watches_of_dropped_jobs_free_their_models(amp, no_collector):
    with without_cyclic_gc():
        refs = [_sweep_trial(amp, {"collector": ()}) for _ in range(5)]
        assert [r() for trial in refs for r in trial] == [None] * 15, "an unclosed watch kept its job alive"


def _sweep_trial_with_everything(amp, collector: str) -> dict[str, weakref.ref]:
    """A trial as a sweep runs it: model, optimizer, LR scheduler, scaler and watch, never closed, then dropped."""
    model = amp.TwoPart()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1)
    scaler = torch.amp.GradScaler("cpu")
    w = agent.watch(scaler, opt, model=model, schedulers=scheduler, collector=collector, run="sweep",
                    push_interval=30.0)
    for poison in (False, True):
        amp.iteration(model, scaler, [opt], torch.randn(4, 8),
                      after_backward=(lambda: amp.poison_grad(model.a.weight)) if poison else None)
        scheduler.step()
    return {"weight": weakref.ref(model.a.weight), "optimizer": weakref.ref(opt),
            "scheduler": weakref.ref(scheduler), "scaler": weakref.ref(scaler), "watch": weakref.ref(w),
            "recorder": weakref.ref(w._recorder), "sender": weakref.ref(w._sender),
            "sender thread": weakref.ref(w._sender._thread)}


def test_a_sweep_of_unclosed_watches_frees_every_trial_by_reference_counting_alone(amp, no_collector):
    # Dropping a trial's scaler ends its watch at once: the model, optimizer state and scheduler go with the
    # trial; the sender thread sends the final batch, ends, and lets go of the rest. No cyclic GC runs.
    with RecordingCollector() as server, without_cyclic_gc():
        trials = [_sweep_trial_with_everything(amp, server.url) for _ in range(4)]
        for what in ("weight", "optimizer", "scheduler", "scaler", "watch"):
            assert [t[what]() for t in trials] == [None] * 4, f"a dropped trial's {what} is still alive"
        assert server.wait_for(lambda s: sum(b["closed"] for b in s.acked) == 4)
        try:
            wait_until(lambda: all(r() is None for t in trials for r in t.values()), every=0.02)
        except AssertionError:
            pass  # said below, naming what is still alive
        alive = sorted({what for t in trials for what, r in t.items() if r() is not None})
    assert alive == [], f"still alive without the cyclic GC: {alive}"
    assert all(b["state"]["optimizers"]["AdamW"]["skipped"] == 1 for b in server.acked if b["closed"])


def test_an_unclosed_watch_whose_scaler_is_collected_closes_itself_and_flushes(amp, no_collector):
    with RecordingCollector() as server:
        weight, scaler, _ = _sweep_trial(amp, {"collector": server.url, "push_interval": 30.0})
        collect_garbage()
        assert scaler() is None
        assert server.wait_for(lambda s: any(b["closed"] for b in s.acked))
        final = [b for b in server.acked if b["closed"]][-1]
        assert final["state"]["optimizers"]["AdamW"]["skipped"] == 1
        kinds = [e["kind"] for b in server.acked for e in b["events"]]
        assert kinds.count("skip") == 1 and kinds[-1] == "close"
    # The sender thread lets go of the job once it has sent the final batch.
    wait_until(lambda: collect_garbage() or weight() is None, what="the job's weight to be freed")


def test_a_kept_watch_keeps_its_scaler_alive(amp, watching):
    model, opt, scaler = small_job(amp)
    w = watching(scaler, opt)
    scaler_ref = weakref.ref(scaler)
    del scaler
    gc.collect()
    assert scaler_ref() is not None and not w.closed


def test_a_collected_scalers_optimizer_stepping_on_says_so_once(amp, no_collector, caplog):
    model, opt, scaler = small_job(amp)
    agent.watch(scaler, opt, collector=(), run="r")  # the handle is dropped at once
    del scaler
    gc.collect()
    new = torch.amp.GradScaler("cpu")
    with caplog.at_level("WARNING", logger="ampwatch.agent"):
        for _ in range(3):
            amp.iteration(model, new, [opt], torch.randn(4, 8))
    said = [r.getMessage() for r in caplog.records if "garbage-collected" in r.getMessage()]
    assert len(said) == 1 and "rebind" in said[0]


@pytest.mark.slow
def test_exit_with_several_unclosed_watches_and_a_hanging_collector_waits_one_close_timeout():
    with RecordingCollector() as server:
        server.delay = 3600.0  # no answer while the process lives (stopping the server ends it)
        script = textwrap.dedent("""
            import atexit, json, sys, time
            import torch
            from ampwatch import agent
            from ampwatch_support.delivery_harness import record_sender_joins
            exit_began = []
            atexit.register(lambda: print(f"flush took {time.monotonic() - exit_began[0]:.3f}; "
                                          f"joins {json.dumps(joins)}"))
            joins = record_sender_joins()
            jobs = []
            for i in range(5):
                model = torch.nn.Linear(4, 4)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                scaler = torch.amp.GradScaler("cpu")
                jobs.append((model, opt, scaler, agent.watch(scaler, opt, collector=sys.argv[1], run=f"r{i}")))
            sys.stdin.readline()  # the test says when every first batch hangs on the collector
            exit_began.append(time.monotonic())
        """)
        env = {**os.environ, "AMPWATCH_CLOSE_TIMEOUT": "2", "AMPWATCH_TIMEOUT": "3600", "AMPWATCH_PUSH_INTERVAL": "30"}
        process = subprocess.Popen([sys.executable, "-c", script, server.url], env=env, stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert server.wait_for(lambda s: len(s.arrivals) == 5, timeout=START_S)
            out, err = process.communicate("go\n", timeout=START_S)
        finally:
            process.kill()
        assert process.returncode == 0, err
        assert server.received == [], "the collector answered: this test proved nothing"
    print("\n" + out.strip())
    took, joins = out.split("flush took ")[1].split("; joins ")
    # Each watch waited its own close timeout in turn before (5 watches: 10 s); two exit handlers each waiting a
    # full timeout would wait 4 s. How long the flush asked to wait in all is a fact of its logic, whatever the
    # machine's speed; that it waited no less, for batches that might still be answered, is a lower bound.
    assert 0 < sum(json.loads(joins)) <= 2.0, (f"the exit flush of 5 unclosed watches waited {joins} "
                                               "with close_timeout=2")
    assert float(took) >= 1.9, f"the exit flush gave up after {float(took):.2f} s with close_timeout=2"
