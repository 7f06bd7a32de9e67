"""ampwatch.agent.transformers.AmpWatchCallback in real Hugging Face Trainer runs, checked against ground truth.

The Trainer leaves mixed precision to Accelerate, which makes a GradScaler only for
fp16 on a GPU. ``CpuFp16Trainer`` (``ampwatch_support.hf_job``) does on CPU what Accelerate
does there (``native_amp = True`` and a ``torch.amp.GradScaler``, here a real
``GradScaler("cpu")``): float16 autocast, the loss scaled in ``backward``, gradients
unscaled for clipping, the optimizer stepped through ``scaler.step`` and ``scaler.update``.
No model download: a tiny local model and an in-memory dataset.
"""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("transformers")

from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from ampwatch.agent.transformers import AmpWatchCallback  # noqa: E402
from ampwatch_support.collector_process import CollectorProcess  # noqa: E402
from ampwatch_support.framework_truth import (  # noqa: E402, F401 (fresh_state: a fixture)
    Truth,  # noqa: E402
    bits,
    counts_at,
    fresh_state,
    params_of,
    rank_at,
    reset_accelerate_state,
    same_bits,
    watch_counts,
)
from ampwatch_support.hf_job import CpuFp16Trainer, Examples, Tiny  # noqa: E402

EXAMPLES = 48
BATCH, ACCUMULATION = 2, 2  # 12 optimizer steps per epoch
POISONED = (9, 22, 23, 41)  # examples holding an inf: updates 2, 5 and 10 skip


class TruthCallback(TrainerCallback):
    """Bracket each optimizer step (the scaler's step and update happen inside) and watch the scheduler advance."""

    def __init__(self) -> None:
        self.truth = Truth()
        self.name = self.last_epoch = None

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.name = type(optimizer.optimizer).__name__
        self.truth.before_step(self.name, params_of(optimizer), optimizer.scaler)

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.truth.after_step(optimizer.scaler)

    def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
        if self.last_epoch is not None:
            for _ in range(lr_scheduler.last_epoch - self.last_epoch):
                self.truth.scheduler_stepped(self.name)
        self.last_epoch = lr_scheduler.last_epoch

    def on_train_begin(self, args, state, control, lr_scheduler=None, **kwargs):
        self.last_epoch = lr_scheduler.last_epoch


@pytest.fixture(autouse=True)
def _every_test_starts_fresh(fresh_state):
    yield fresh_state


def train(tmp_path, callbacks, *, trainer_class=CpuFp16Trainer, resume=None, eval_dataset=None, **settings):
    reset_accelerate_state()
    torch.manual_seed(0)
    truth = TruthCallback()
    args = dict(output_dir=str(tmp_path / "out"), use_cpu=True, fp16=True, per_device_train_batch_size=BATCH,
                gradient_accumulation_steps=ACCUMULATION, num_train_epochs=1, learning_rate=1e-2,
                optim="adamw_torch_fused", train_sampling_strategy="sequential", report_to="none",
                logging_strategy="no", save_strategy="no", disable_tqdm=True, seed=0)
    args.update(settings)
    trainer = trainer_class(model=Tiny(), args=TrainingArguments(**args), train_dataset=Examples(EXAMPLES, POISONED),
                            eval_dataset=eval_dataset, callbacks=[truth, *callbacks])
    trainer.train(resume_from_checkpoint=resume)
    return trainer, truth.truth


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_training_and_a_resume_from_a_checkpoint_report_ground_truth_to_a_collector(tmp_path, fresh_state):
    with CollectorProcess(str(tmp_path / "ampwatch.db")) as collector:
        fresh_state.setenv("AMPWATCH_URL", collector.url)
        fresh_state.setenv("AMPWATCH_RUN", "hf-resume")
        first = AmpWatchCallback()
        trainer, truth = train(tmp_path, [first], save_strategy="steps", save_steps=4)
        counts = truth.counts()
        assert first.watch.closed and watch_counts(first.watch.snapshot()) == counts
        assert counts["optimizers"]["AdamW"]["skipped"] == 3 and counts["growths"] > 0
        # The fused AdamW skips inside its kernel, Accelerate's step_was_skipped says "stepped",
        # and the Trainer steps the LR schedule on every skipped update (accelerate #4242).
        assert counts["optimizers"]["AdamW"]["scheduler_steps_after_skip"] == 3
        assert "step" not in vars(trainer.accelerator.scaler) and "step" not in vars(trainer.lr_scheduler)

        # A new Trainer resumes from the checkpoint after update 4 (its scale, optimizer and scheduler
        # are loaded before training begins, so the watch starts from them: no transition at all).
        second = AmpWatchCallback()
        resumed, truth2 = train(tmp_path, [second], resume=str(tmp_path / "out" / "checkpoint-4"))
        assert watch_counts(second.watch.snapshot()) == truth2.counts()
        assert sum(truth2.steps.values()) + sum(truth2.skipped.values()) == 12 - 4
        rank = rank_at(collector.url, "hf-resume")
    assert counts_at(rank) == truth2.add(counts)
    assert rank["incarnations"] == 2 and rank["closed"] and rank["delivery"]["rejected_batches"] == 0


def test_training_is_bit_identical_with_and_without_the_callback(tmp_path):
    callback = AmpWatchCallback(name="main")
    watched, truth = train(tmp_path, [callback])
    plain, plain_truth = train(tmp_path, [])
    assert set(callback.watch.snapshot()["state"]["optimizers"]) == {"main"}
    assert truth.counts() == plain_truth.counts() and sum(truth.skipped.values()) == 3
    assert same_bits(bits(watched.model.parameters()), bits(plain.model.parameters()))
    assert watched.accelerator.scaler.get_scale() == plain.accelerator.scaler.get_scale()


def test_a_plain_optimizer_keeps_the_schedule_in_step_and_ampwatch_agrees(tmp_path):
    callback = AmpWatchCallback()
    _, truth = train(tmp_path, [callback], optim="adamw_torch")
    counts = truth.counts()
    assert watch_counts(callback.watch.snapshot()) == counts
    assert counts["optimizers"]["AdamW"]["skipped"] == 3
    assert counts["optimizers"]["AdamW"]["scheduler_steps_after_skip"] == 0


def test_reduce_lr_on_plateau_stepped_after_each_evaluation_is_not_watched_as_a_per_update_schedule(tmp_path):
    # The Trainer steps ReduceLROnPlateau on the metrics of each evaluation, here after every update, the three
    # skipped ones included: nothing runs ahead of the updates, so none of those steps is counted.
    callback = AmpWatchCallback()
    trainer, _ = train(tmp_path, [callback], optim="adamw_torch", lr_scheduler_type="reduce_lr_on_plateau",
                       eval_strategy="steps", eval_steps=1, metric_for_best_model="loss",
                       eval_dataset=Examples(2))
    assert isinstance(trainer.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    assert trainer.lr_scheduler.last_epoch == 12  # stepped once per update: after each evaluation
    counters = callback.watch.snapshot()["state"]["optimizers"]["AdamW"]
    assert counters["skipped"] == 3 and counters["scheduler_steps_after_skip"] == 0


def test_in_bf16_every_update_is_checked_and_poisoned_steps_are_the_truth(tmp_path, caplog):
    callback = AmpWatchCallback()
    with caplog.at_level(logging.INFO, logger="ampwatch.agent"):
        watched, truth = train(tmp_path, [callback], trainer_class=Trainer, fp16=False, bf16=True)
        first, counts = callback.watch, truth.counts()
        watched.train()  # a second train() with the same callback: not said again
    said = [r for r in caplog.records if r.name == "ampwatch.agent"]
    assert len(said) == 1 and said[0].levelno == logging.INFO, said
    assert "bf16=True" in said[0].getMessage() and "poisoned" in said[0].getMessage()
    assert watch_counts(first.snapshot()) == counts
    assert counts["optimizers"]["AdamW"]["poisoned_steps"] == 10  # update 3 holds an inf; NaN weights after it
    assert first.closed and not watched.optimizer.optimizer._optimizer_step_pre_hooks
    plain, _ = train(tmp_path, [], trainer_class=Trainer, fp16=False, bf16=True)
    assert same_bits(bits(watched.model.parameters()), bits(plain.model.parameters()))


def test_fp16_on_cpu_gets_no_scaler_and_the_warning_says_what_the_trainer_did_and_what_to_do(tmp_path, caplog):
    callback = AmpWatchCallback()
    with caplog.at_level(logging.INFO, logger="ampwatch.agent"):
        train(tmp_path, [callback], trainer_class=Trainer, fp16=True, max_steps=1)
    (said,) = [r for r in caplog.records if r.name == "ampwatch.agent"]
    assert said.levelno == logging.WARNING
    assert "fp16=True" in said.getMessage() and "float32" in said.getMessage()
    assert "examples/transformers_cpu.py" in said.getMessage()
