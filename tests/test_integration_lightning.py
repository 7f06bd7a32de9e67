"""ampwatch.agent.lightning.AmpWatchCallback in real Lightning fits, checked against ground truth.

Float16 autocast with a real ``torch.amp.GradScaler("cpu")`` through Lightning's own
MixedPrecision plugin (on CPU ``precision="16-mixed"`` would silently become bf16
without a scaler); overflow injected at known batches; ground truth from parameter
bit patterns and the scaler's own scale (``ampwatch_support.framework_truth``).
"""

from __future__ import annotations

import csv
import json
import logging
import os
import pickle
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from ampwatch.agent.lightning import AmpWatchCallback  # noqa: E402
from ampwatch_support.collector_process import CollectorProcess  # noqa: E402
from ampwatch_support.framework_truth import bits, counts_at, rank_at, same_bits, watch_counts  # noqa: E402
from ampwatch_support.lightning_job import OneOptimizer, TwoOptimizers, data, fp16_plugin, trainer  # noqa: E402

DDP_JOB = Path(__file__).with_name("lightning_ddp_job.py")
# Batch numbers over the whole fit -> the part whose gradients get an inf: a streak of two on
# `a`, and `b` skipping at the last batch of epoch 0, right before its per-epoch scheduler steps.
POISON = {1: "a", 3: "b", 5: "b", 8: "a", 9: "a"}

pytestmark = pytest.mark.filterwarnings("ignore")  # Lightning's advice on dataloader workers and loggers


@pytest.fixture
def agent_env(monkeypatch):
    for var in ("AMPWATCH_URL", "AMPWATCH_RUN", "AMPWATCH_DISABLED", "AMPWATCH_SPOOL_DIR"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def fit(poison=POISON, callbacks=(), ckpt_path=None, max_epochs=2, seed=0, **kwargs):
    torch.manual_seed(seed)
    module = TwoOptimizers(poison)
    run = trainer(max_epochs=max_epochs, callbacks=list(callbacks), **kwargs)
    run.fit(module, data(), ckpt_path=ckpt_path)
    return module, run


def fp16(**scaler):
    return [fp16_plugin(**{"init_scale": 1024.0, "growth_interval": 3, **scaler})]


def unpatched(scaler, optimizers):
    """Nothing of the agent is left on the scaler or the optimizers."""
    return (not {"step", "update", "load_state_dict"} & set(vars(scaler))
            and all(not opt._optimizer_step_pre_hooks for opt in optimizers))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_fit_and_its_resume_from_a_checkpoint_report_ground_truth_to_a_collector(tmp_path, agent_env):
    with CollectorProcess(str(tmp_path / "ampwatch.db")) as collector:
        agent_env.setenv("AMPWATCH_URL", collector.url)
        agent_env.setenv("AMPWATCH_RUN", "lightning-resume")
        first = AmpWatchCallback()
        saves = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
        module, run = fit(callbacks=[first, saves], plugins=fp16(), enable_checkpointing=True)
        scaler = run.precision_plugin.scaler
        assert first.watch.closed and unpatched(scaler, run.optimizers)
        truth = module.truth.counts()
        assert watch_counts(first.watch.snapshot()) == truth
        assert truth["optimizers"]["a"]["skipped"] == 3 and truth["optimizers"]["b"]["skipped"] == 2
        assert truth["backoffs"] and truth["growths"] and truth["optimizers"]["a"]["scheduler_steps_after_skip"]
        # b skipped right before its per-epoch scheduler stepped: declared per epoch, so not counted.
        assert module.epoch_ends_after_b_skipped == 1
        assert truth["optimizers"]["b"]["scheduler_steps_after_skip"] == 0

        # The checkpoints were written while watched; resume from one in the middle of epoch 0
        # with a new module, Trainer, plugin, scaler and callback (a new process would do the same).
        checkpoint = tmp_path / "ckpt" / "epoch=0-step=8.ckpt"
        saved = torch.load(checkpoint, weights_only=False)
        assert saved["MixedPrecision"]["scale"] != 1024.0, "pick a checkpoint whose scale differs from init"
        second = AmpWatchCallback()
        resumed, run2 = fit(callbacks=[second], ckpt_path=str(checkpoint), max_epochs=3, plugins=fp16())
        assert second.watch.closed and unpatched(run2.precision_plugin.scaler, run2.optimizers)
        # The restore is not a backoff or growth: the in-process counts match the truth of this fit.
        assert watch_counts(second.watch.snapshot()) == resumed.truth.counts()

        rank = rank_at(collector.url, "lightning-resume")
        with urllib.request.urlopen(f"{collector.url}/v1/runs/lightning-resume/events?kind=scale_change&limit=1000",
                                    timeout=10) as answer:
            changes = json.loads(answer.read())["events"]
    assert counts_at(rank) == resumed.truth.add(truth)
    assert rank["incarnations"] == 2 and rank["closed"] and rank["delivery"]["rejected_batches"] == 0
    restores = [(e["before"], e["after"]) for e in changes if e["cause"] == "restored"]
    assert restores == [(1024.0, saved["MixedPrecision"]["scale"])]


def test_training_is_bit_identical_with_and_without_the_callback(agent_env):
    watched, _ = fit(callbacks=[AmpWatchCallback()], plugins=fp16())
    plain, _ = fit(plugins=fp16())
    assert watched.truth.counts() == plain.truth.counts() and sum(plain.truth.skipped.values()) == 5
    assert same_bits(bits(watched.parameters()), bits(plain.parameters()))


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_without_a_scaler_every_step_is_checked_and_poisoned_steps_are_the_truth(agent_env, caplog, precision):
    callback = AmpWatchCallback()
    with caplog.at_level(logging.INFO, logger="ampwatch.agent"):
        watched, run = fit(callbacks=[callback], precision=precision, max_epochs=1)
        first = callback.watch
        fit(callbacks=[callback], precision=precision, max_epochs=1)  # the same callback again: said once
    said = [r.getMessage() for r in caplog.records if r.name == "ampwatch.agent"]
    assert len(said) == 1, said
    assert f"precision {precision!r}" in said[0] and "made no GradScaler" in said[0] and "poisoned" in said[0]
    assert "MixedPrecision('16-mixed', 'cpu')" in said[0]  # on CPU: how to get a real GradScaler
    truth = watched.truth.counts()
    assert watch_counts(first.snapshot()) == truth
    # The inf of batch 1 went into a's weights: every later step of both is poisoned too.
    assert truth["optimizers"]["a"]["poisoned_steps"] == 5 and truth["optimizers"]["b"]["poisoned_steps"] == 5
    assert first.closed and all(not o._optimizer_step_pre_hooks and not o._optimizer_step_post_hooks
                                for o in run.optimizers)
    plain, _ = fit(precision=precision, max_epochs=1)
    assert same_bits(bits(watched.parameters()), bits(plain.parameters()))


def test_in_bf16_a_step_given_a_closure_is_checked_after_the_closure_made_its_gradients(agent_env):
    """Automatic optimization: Lightning calls optimizer.step(closure), which runs forward and backward inside."""
    callback = AmpWatchCallback()
    torch.manual_seed(0)
    module = OneOptimizer(poison={3: (0,)})
    trainer(max_epochs=1, callbacks=[callback], precision="bf16-mixed").fit(module, data())
    truth = module.truth.counts()
    assert truth["optimizers"]["SGD"]["poisoned_steps"] == 3  # batch 3 and the two after it (NaN weights)
    assert watch_counts(callback.watch.snapshot()) == truth


def test_an_exception_in_the_fit_detaches_the_agent_and_goes_on(agent_env):
    class Broken(TwoOptimizers):
        def training_step(self, x, batch_idx):
            if batch_idx == 2:
                raise RuntimeError("boom at batch 2")
            return super().training_step(x, batch_idx)

    callback = AmpWatchCallback()
    torch.manual_seed(0)
    run = trainer(max_epochs=1, callbacks=[callback], plugins=fp16())
    with pytest.raises(RuntimeError, match="boom at batch 2"):
        run.fit(Broken(POISON), data())
    assert callback.watch.closed
    assert unpatched(run.precision_plugin.scaler, run.optimizers)
    counters = callback.watch.snapshot()["state"]["optimizers"]["a"]
    assert (counters["steps"], counters["skipped"]) == (1, 1)  # batch 0 stepped, batch 1 was poisoned


def test_the_callback_pickles_without_its_watch_and_fits_again(agent_env):
    callback = AmpWatchCallback(names=["encoder", "head"])
    fit(callbacks=[callback], plugins=fp16(), max_epochs=1)
    first = callback.watch
    copy = pickle.loads(pickle.dumps(callback))  # as ddp_spawn sends a Trainer's callbacks to its workers
    assert copy.watch is None and copy.names == ["encoder", "head"]
    module, _ = fit(callbacks=[callback], plugins=fp16(), max_epochs=1)  # the same callback, a second fit
    assert first.closed and callback.watch is not first and callback.watch.closed
    assert watch_counts(callback.watch.snapshot())["optimizers"]["encoder"]["skipped"] == module.truth.skipped["a"]


def test_optimizers_are_named_as_asked_and_a_wrong_count_says_what_to_do(agent_env):
    callback = AmpWatchCallback(names=["encoder", "head"])
    fit(callbacks=[callback], plugins=fp16(), max_epochs=1)
    assert set(callback.watch.snapshot()["state"]["optimizers"]) == {"encoder", "head"}
    with pytest.raises(ValueError, match="got 1 names for 2 optimizers"):
        fit(callbacks=[AmpWatchCallback(names=["only"])], plugins=fp16(), max_epochs=1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'url'"):
        AmpWatchCallback(url="http://x")


def test_log_metrics_puts_the_loss_scale_and_skips_beside_the_loss(agent_env, tmp_path):
    callback = AmpWatchCallback(log_metrics=True)
    module, run = fit(callbacks=[callback], plugins=fp16(), logger=CSVLogger(tmp_path), log_every_n_steps=1)
    with open(Path(run.logger.log_dir) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 12  # one per batch
    last = rows[-1]
    assert float(last["ampwatch/loss_scale"]) == run.precision_plugin.scaler.get_scale()
    assert float(last["ampwatch/a/skipped_steps"]) == module.truth.skipped["a"] == 3
    assert float(last["ampwatch/b/skipped_steps"]) == module.truth.skipped["b"] == 2


def test_the_pytorch_lightning_package_gets_the_same_callback(agent_env):
    pl = pytest.importorskip("pytorch_lightning")
    from ampwatch.agent.pytorch_lightning import AmpWatchCallback as ClassicCallback

    class Classic(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 4)

        def training_step(self, x, batch_idx):
            return self.net(x).float().pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    callback = ClassicCallback()
    assert isinstance(callback, pl.Callback)
    plugin = pl.plugins.MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    run = pl.Trainer(accelerator="cpu", max_epochs=1, plugins=[plugin], callbacks=[callback], logger=False,
                     enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    run.fit(Classic(), data())
    assert callback.watch.closed and callback.watch.snapshot()["state"]["optimizers"]["SGD"]["steps"] == 6


@pytest.fixture(scope="module")
def two_process_fits(tmp_path_factory):
    """One 2-process launch (Lightning's own launcher) of a DDP fit reported to a collector, then an FSDP2 fit
    in the same processes: (the DDP fit's ranks as the collector has them, the output folder)."""
    out = tmp_path_factory.mktemp("lightning-two-process")
    with CollectorProcess(str(out / "ampwatch.db")) as collector:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("AMPWATCH_") and k not in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")}
        env["AMPWATCH_URL"] = collector.url  # nothing else: rank, world size and run id come from the launch
        job = subprocess.run([sys.executable, str(DDP_JOB), str(out), "ddp", "fsdp2"], env=env, cwd=out,
                             capture_output=True, text=True, timeout=400)
        assert job.returncode == 0, job.stderr[-4000:]
        with urllib.request.urlopen(collector.url + "/v1/runs", timeout=10) as answer:
            (run,) = json.loads(answer.read())["runs"]
        ranks = {r: rank_at(collector.url, run["run"], r) for r in (0, 1)}
    return ranks, out


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_a_two_process_ddp_fit_reports_both_ranks_under_one_run(two_process_fits):
    ranks, out = two_process_fits
    for r, rank in ranks.items():
        result = json.loads((out / f"rank{r}.json").read_text())
        truth = result["truth"]
        assert result["closed"] and result["watch"] == truth
        assert counts_at(rank) == truth, f"rank {r}"
        assert rank["world_size"] == 2 and rank["closed"]
        # DDP spread each rank's inf to both: both skipped at all three poisoned batches, and
        # Lightning stepped the per-step scheduler right after each of those skips.
        assert truth["optimizers"]["SGD"]["skipped"] == 3
        assert truth["optimizers"]["SGD"]["scheduler_steps_after_skip"] == 3
        assert result["scheduler_steps"] == sum(truth["optimizers"]["SGD"][k] for k in ("steps", "skipped"))
        # log_metrics: every batch from rank 0 (6 per epoch and rank, 2 epochs), nothing from rank 1.
        assert result["ampwatch_logged"] == (12 if r == 0 else 0), f"rank {r}"


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_a_two_process_fsdp2_fit_in_bf16_reports_each_ranks_poisoned_steps(two_process_fits):
    """Lightning's ModelParallelStrategy (FSDP2's fully_shard) runs on CPU: the callback attaches to it."""
    _, out = two_process_fits
    for r in (0, 1):
        result = json.loads((out / f"rank{r}-fsdp2.json").read_text())
        assert result["sharded"] and result["closed"] and result["agent_errors"] == 0
        assert result["scaler"]["kind"] == "none" and result["watch"] == result["truth"]
        # Rank 0's inf at its batch 1 reached both ranks' shards: every step from there on is poisoned.
        assert result["truth"]["optimizers"]["SGD"]["poisoned_steps"] == 5
