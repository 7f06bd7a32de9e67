"""ampwatch.agent.accelerate.watch in real Accelerate loops, checked against ground truth.

On a GPU, ``Accelerator(mixed_precision="fp16")`` sets ``native_amp = True`` and makes a
``torch.amp.GradScaler``; on CPU it makes none (fp16 becomes fp32). ``gpu_like_fp16``
(``ampwatch_support.framework_truth``) does on CPU what Accelerate does on a GPU, with a real
``GradScaler("cpu")``: float16 autocast in the prepared model, ``accelerator.backward``
scaling the loss, and every prepared optimizer stepping through ``scaler.step`` and
``scaler.update``.
Ground truth: parameter bit patterns and the scaler's own scale (``ampwatch_support.framework_truth``).
"""

from __future__ import annotations

import json
import logging
import urllib.request

import pytest
import torch

pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402

from ampwatch.agent import accelerate as ampwatch  # noqa: E402
from ampwatch_support.collector_process import CollectorProcess  # noqa: E402
from ampwatch_support.framework_truth import (  # noqa: E402, F401 (fresh_state: a fixture)
    INF,
    Truth,
    bits,
    counts_at,
    fresh_state,
    gpu_like_fp16,
    params_of,
    rank_at,
    reset_accelerate_state,
    same_bits,
    watch_counts,
)

ACCUMULATION = 2
SYNC_STEPS = 12
SAVE_AT = 5  # sync steps done when the state is saved; the resumed run starts there
# Sync step -> the part whose gradients get an inf on the last micro-batch: `b` (fused AdamW)
# skips, and Accelerate still steps b's scheduler (accelerate #4242); `a` skips twice in a row.
POISON = {2: "b", 4: "a", 5: "a", 8: "b"}


class TwoPart(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


@pytest.fixture(autouse=True)
def _every_test_starts_fresh(fresh_state):
    yield fresh_state


def fp16_accelerator(**kwargs) -> Accelerator:
    """An Accelerator set up as Accelerate sets one up for fp16 on a GPU, with a real CPU GradScaler."""
    accelerator = Accelerator(mixed_precision="fp16", cpu=True, gradient_accumulation_steps=ACCUMULATION, **kwargs)
    return gpu_like_fp16(accelerator, init_scale=1024.0, growth_interval=3)


def job(accelerator: Accelerator):
    """Prepared model, two optimizers (plain SGD, fused AdamW) and their per-step schedulers."""
    torch.manual_seed(0)
    model = TwoPart()
    opt_a = torch.optim.SGD(model.a.parameters(), lr=0.05)
    opt_b = torch.optim.AdamW(model.b.parameters(), lr=1e-3, fused=True)
    sched_a = torch.optim.lr_scheduler.StepLR(opt_a, 1, 0.99)
    sched_b = torch.optim.lr_scheduler.StepLR(opt_b, 1, 0.99)
    return accelerator.prepare(model, opt_a, opt_b, sched_a, sched_b)


def batches():
    return list(torch.randn(SYNC_STEPS * ACCUMULATION, 4, 8, generator=torch.Generator().manual_seed(1)))


def train(accelerator, model, optimizers, schedulers, truth: Truth, first_sync_step: int = 0,
          save_to=None) -> None:
    """The loop Accelerate documents: step and schedule every micro-batch inside ``accumulate``.

    ``save_to``: ``accelerator.save_state`` there once ``SAVE_AT`` sync steps are done.
    """
    scaler = accelerator.scaler
    sync_step = first_sync_step
    for x in batches()[first_sync_step * ACCUMULATION:]:
        with accelerator.accumulate(model):
            accelerator.backward(model(x).float().pow(2).mean())
            syncing = accelerator.sync_gradients
            if syncing and POISON.get(sync_step):
                getattr(accelerator.unwrap_model(model), POISON[sync_step]).weight.grad.view(-1)[0] = INF
            for name, opt in zip("ab", optimizers, strict=True):
                if syncing:
                    truth.step(name, params_of(opt), scaler, opt.step)
                else:  # Accelerate does nothing here: no step, no skip, no update
                    before = bits(params_of(opt))
                    opt.step()
                    assert same_bits(before, bits(params_of(opt)))
            for name, sched in zip("ab", schedulers, strict=True):
                before = sched.scheduler.last_epoch
                sched.step()
                for _ in range(sched.scheduler.last_epoch - before):
                    truth.scheduler_stepped(name)
            for opt in optimizers:
                opt.zero_grad()
        sync_step += syncing
        if syncing and sync_step == SAVE_AT and save_to is not None:
            accelerator.save_state(save_to)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_accumulation_and_a_load_state_resume_report_ground_truth_to_a_collector(tmp_path, fresh_state):
    with CollectorProcess(str(tmp_path / "ampwatch.db")) as collector:
        fresh_state.setenv("AMPWATCH_URL", collector.url)
        fresh_state.setenv("AMPWATCH_RUN", "accelerate-resume")
        accelerator = fp16_accelerator()
        model, opt_a, opt_b, sched_a, sched_b = job(accelerator)
        watch = ampwatch.watch(accelerator, [opt_a, opt_b], [sched_a, sched_b], model=model)
        truth = Truth()
        train(accelerator, model, [opt_a, opt_b], [sched_a, sched_b], truth, save_to=tmp_path / "state")
        watch.close()
        saved_scale = torch.load(tmp_path / "state" / "scaler.pt", weights_only=False)["scale"]
        first = truth.counts()
        assert watch_counts(watch.snapshot()) == first
        assert watch.snapshot()["state"]["iteration"] == 2 * SYNC_STEPS  # one update per optimizer step
        assert first["optimizers"]["a"]["skipped"] == 2 and first["optimizers"]["b"]["skipped"] == 2
        # Accelerate's step_was_skipped misses a fused optimizer's skips: b's scheduler stepped after both.
        assert first["optimizers"]["b"]["scheduler_steps_after_skip"] == 2
        assert first["optimizers"]["a"]["scheduler_steps_after_skip"] == 0

        reset_accelerate_state()
        accelerator = fp16_accelerator()
        model, opt_a, opt_b, sched_a, sched_b = job(accelerator)
        watch = ampwatch.watch(accelerator, [opt_a, opt_b], [sched_a, sched_b], model=model)
        accelerator.load_state(tmp_path / "state")
        assert accelerator.scaler.get_scale() == saved_scale != 1024.0
        truth = Truth()
        train(accelerator, model, [opt_a, opt_b], [sched_a, sched_b], truth, first_sync_step=SAVE_AT)
        watch.close()
        assert watch_counts(watch.snapshot()) == truth.counts()  # the restore is no backoff or growth
        rank = rank_at(collector.url, "accelerate-resume")
        with urllib.request.urlopen(f"{collector.url}/v1/runs/accelerate-resume/events?kind=scale_change"
                                    "&limit=1000", timeout=10) as answer:
            changes = json.loads(answer.read())["events"]
    assert counts_at(rank) == truth.add(first)
    assert rank["incarnations"] == 2 and rank["closed"] and rank["delivery"]["rejected_batches"] == 0
    assert [(e["before"], e["after"]) for e in changes if e["cause"] == "restored"] == [(1024.0, saved_scale)]


def test_training_is_bit_identical_with_and_without_the_agent(fresh_state):
    results = []
    for watched in (True, False):
        reset_accelerate_state()
        accelerator = fp16_accelerator()
        model, opt_a, opt_b, sched_a, sched_b = job(accelerator)
        if watched:
            watch = ampwatch.watch(accelerator, {"a": opt_a, "b": opt_b}, [sched_a, sched_b], model=model)
        truth = Truth()
        train(accelerator, model, [opt_a, opt_b], [sched_a, sched_b], truth)
        if watched:
            assert watch_counts(watch.snapshot()) == truth.counts()
            watch.close()
        results.append((bits(model.parameters()), accelerator.scaler.get_scale(), truth.counts()))
    (watched_bits, watched_scale, watched_truth), (plain_bits, plain_scale, plain_truth) = results
    assert same_bits(watched_bits, plain_bits) and watched_scale == plain_scale and watched_truth == plain_truth


def test_the_outer_accelerated_scheduler_is_not_what_is_watched(fresh_state):
    # Under accumulation the user steps the AcceleratedScheduler every micro-batch; it advances
    # the scheduler inside only when gradients sync. Watching the outer one would count a
    # micro-batch after a skip as a scheduler step; the inner one counts only real advances.
    accelerator = fp16_accelerator()
    model, opt_a, opt_b, sched_a, sched_b = job(accelerator)
    watch = ampwatch.watch(accelerator, [opt_a, opt_b], [sched_a, sched_b], model=model)
    assert "step" not in vars(sched_a) and "step" in vars(sched_a.scheduler)
    assert "backward" not in vars(accelerator)  # with a scaler its scale() notes the loss: no loss tap
    watch.close()
    assert "step" not in vars(sched_a.scheduler)


def bf16_run(watched: bool) -> tuple[Truth, list, object]:
    accelerator = Accelerator(mixed_precision="bf16", cpu=True, gradient_accumulation_steps=ACCUMULATION)
    model, opt_a, opt_b, sched_a, sched_b = job(accelerator)
    watch = ampwatch.watch(accelerator, [opt_a, opt_b], [sched_a, sched_b], model=model) if watched else None
    truth = Truth()
    train(accelerator, model, [opt_a, opt_b], [sched_a, sched_b], truth)
    if watch is not None:
        watch.close()
        assert not opt_a.optimizer._optimizer_step_pre_hooks and "step" not in vars(sched_a.scheduler)
    reset_accelerate_state()
    return truth, bits(model.parameters()), watch


def test_in_bf16_every_step_is_checked_and_poisoned_steps_are_the_truth(fresh_state, caplog):
    with caplog.at_level(logging.INFO, logger="ampwatch.agent"):
        truth, trained, watch = bf16_run(watched=True)
    (said,) = [r for r in caplog.records if r.name == "ampwatch.agent"]
    assert said.levelno == logging.INFO and "mixed_precision='bf16'" in said.getMessage()
    counts = truth.counts()
    assert watch_counts(watch.snapshot()) == counts
    # b's inf at sync step 2 stays in its weights, so every later step of b is poisoned, and of a from the next
    # one (b's NaN weights reach a's gradients in backward).
    assert counts["optimizers"]["b"]["poisoned_steps"] == 10 and counts["optimizers"]["a"]["poisoned_steps"] == 9
    assert watch.snapshot()["state"]["iteration"] == SYNC_STEPS  # one iteration: both optimizers' steps
    _, plain, _ = bf16_run(watched=False)
    assert same_bits(trained, plain)


def test_fp16_on_cpu_gets_no_scaler_and_the_warning_says_what_accelerate_did_and_what_to_do(fresh_state, caplog):
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    model, opt_a, opt_b, _, _ = job(accelerator)
    with caplog.at_level(logging.INFO, logger="ampwatch.agent"):
        ampwatch.watch(accelerator, [opt_a, opt_b], model=model).close()
    (said,) = [r for r in caplog.records if r.name == "ampwatch.agent"]
    assert said.levelno == logging.WARNING and "float32" in said.getMessage()
    assert "examples/accelerate_cpu.py" in said.getMessage()


def test_options_that_watch_does_not_take_are_refused(fresh_state):
    accelerator = fp16_accelerator()
    model, opt_a, opt_b, sched_a, sched_b = job(accelerator)
    with pytest.raises(TypeError, match="unexpected keyword argument 'names'"):
        ampwatch.watch(accelerator, [opt_a, opt_b], names=["x", "y"])


def test_the_norm_clip_grad_norm_returns_is_watched_for_spikes_and_training_stays_bit_identical(fresh_state):
    """One optimizer: each norm ``accelerator.clip_grad_norm_`` returns goes to ``watch.grad_norm`` (issue 40); one
    sync step's gradients x1,000 (a tensor hook) is a ``grad_norm_spike`` at that iteration, and nothing else."""
    fresh_state.setenv("AMPWATCH_SPIKE_WINDOW", "4")
    steep = 8  # the sync step whose gradients are x1,000
    results = []
    for watched in (True, False):
        reset_accelerate_state()
        accelerator = fp16_accelerator()
        torch.manual_seed(0)
        net = TwoPart()
        model, opt = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=1e-3))
        watch = ampwatch.watch(accelerator, opt, model=model) if watched else None
        for k, x in enumerate(batches()):
            with accelerator.accumulate(model):
                sync_step = k // ACCUMULATION
                hook = model.a.weight.register_hook(lambda g: g * 1000) if sync_step == steep else None
                accelerator.backward(model(x).float().pow(2).mean())
                if hook is not None:
                    hook.remove()
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1e9)
                opt.step()
                opt.zero_grad()
        if watch is not None:
            watch.close()
            assert "clip_grad_norm_" not in vars(accelerator)  # taken off at close
            spikes = [e for e in watch._recorder.events.drain() if e["kind"] == "grad_norm_spike"]
            assert [(e["iteration"], e["streak"]) for e in spikes] == [(steep, 1)]
            assert watch.snapshot()["state"]["optimizers"]["SGD"]["grad_norm_spikes"] == 1
        results.append(bits(model.parameters()))
    assert same_bits(*results)
