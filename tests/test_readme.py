"""The snippets of the README and of docs/recipes.md run as written (on CPU) and report what they claim, one through
a real collector.

Each snippet is found by the page and the heading of its section (``SNIPPETS``): a snippet moved from one page to
another keeps its test by moving its entry, and a snippet no test runs fails
``test_every_python_snippet_of_the_readme_and_the_recipes_is_run_by_a_test``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from ampwatch.contract.batch import samples_digest
from ampwatch_support.batches import APPLIED, make_batch
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.framework_truth import reset_accelerate_state
from ampwatch_support.ports import free_port
from ampwatch_support.rank_processes import wait_for

ROOT = Path(__file__).resolve().parents[1]
README, RECIPES = "README.md", "docs/recipes.md"

PLAIN_LOOP = (README, "## Attach the agent to your training loop")
BF16 = (README, "## bf16 and float32, without a GradScaler")
FRAMEWORKS = (README, "## Attach to your framework")
COLLECTOR = (README, "## Run the collector for real")
TWO_OPTIMIZERS = (RECIPES, "## Several optimizers, clipping after `unscale_`, and a scheduler gated on real updates")
ACCUMULATION = (RECIPES, "## Gradient accumulation")
SAMPLES = (RECIPES, "## Which samples a skip trained on")
FUSED = (RECIPES, "## Fused optimizers")
FSDP2 = (RECIPES, "## FSDP2")
CHECKPOINTS = (RECIPES, "## Checkpoints and resumes")

SNIPPETS = {PLAIN_LOOP: 1, BF16: 1, FRAMEWORKS: 3, TWO_OPTIMIZERS: 1, ACCUMULATION: 1, SAMPLES: 1, FUSED: 1,
            FSDP2: 1, CHECKPOINTS: 1}
"""Every Python snippet of the README and docs/recipes.md: (page, heading of its section) -> how many the section
holds, each run by a test below."""

# What the snippets take as given; batch 2 holds an inf, so exactly one optimizer step skips.
PREAMBLE = '''
import torch
from torch import nn
from ampwatch import agent
torch.manual_seed(0)
class GAN(nn.Module):
    def __init__(self):
        super().__init__()
        self.generator, self.critic = nn.Linear(8, 8), nn.Linear(8, 1)
    def forward(self, x):
        return self.critic(self.generator(x))
model = GAN()
loader = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(6)]
loader[2][0][0, 0] = float("inf")
indexed_loader = [(torch.arange(4 * k, 4 * k + 4), x, y) for k, (x, y) in enumerate(loader)]  # each sample's id
loss_fn = lambda out, y: nn.functional.mse_loss(out.float(), y)
opt_g = torch.optim.AdamW(model.generator.parameters(), lr=1e-3)
opt_d = torch.optim.SGD(model.critic.parameters(), lr=1e-2)
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
sched_g = torch.optim.lr_scheduler.StepLR(opt_g, step_size=1)
scaler = torch.amp.GradScaler("cpu")
accumulation = 2
'''


def _snippets(where: tuple[str, str], language: str = "python") -> list[str]:
    """The ``language`` snippets of the section of page ``where[0]`` whose heading line is ``where[1]``, up to the
    next heading of its level or above (a ``#`` line inside a code block is no heading)."""
    page, heading = where
    lines = (ROOT / page).read_text().splitlines(keepends=True)
    assert heading + "\n" in lines, f"{page} has no heading {heading!r}: update this test"
    level, section, fenced = len(heading.split(" ", 1)[0]), [], False
    for line in lines[lines.index(heading + "\n") + 1:]:
        fenced ^= line.startswith("```")
        if not fenced and re.match(rf"#{{1,{level}}} ", line):
            break
        section.append(line)
    return re.findall(rf"```{language}\n(.*?)```", "".join(section), flags=re.S)


def _snippet(where: tuple[str, str]) -> str:
    (snippet,) = _snippets(where)
    return snippet


def _run(snippet: str, monkeypatch, page: str = README) -> dict:
    monkeypatch.delenv("AMPWATCH_URL", raising=False)
    monkeypatch.setenv("AMPWATCH_RUN", "readme")
    # This machine has no GPU: the same code on CPU, with CPU autocast's half type.
    code = snippet.replace('"cuda"', '"cpu"').replace("torch.float16", "torch.bfloat16")
    namespace: dict = {}
    exec(compile(PREAMBLE + code, page, "exec"), namespace)
    namespace["watch"].close()
    return namespace


def test_every_python_snippet_of_the_readme_and_the_recipes_is_run_by_a_test():
    for page in (README, RECIPES):
        held = {heading: count for (on, heading), count in SNIPPETS.items() if on == page}
        assert {heading: len(_snippets((page, heading))) for heading in held} == held, page
        every = re.findall(r"^```python$", (ROOT / page).read_text(), flags=re.M)
        assert len(every) == sum(held.values()), f"{page} holds a Python snippet that no test runs"


@pytest.mark.timeout(120)
def test_the_plain_loop_snippet_reports_its_skip_to_a_real_collector(tmp_path, monkeypatch):
    with CollectorProcess(str(tmp_path / "ampwatch.db")) as collector:
        snippet = _snippet(PLAIN_LOOP).replace("http://127.0.0.1:9457", collector.url)
        _run(snippet, monkeypatch)
        with urllib.request.urlopen(collector.url + "/v1/runs/exp-42", timeout=5) as answer:
            (rank,) = json.loads(answer.read())["ranks"]
    assert rank["closed"] and rank["iteration"] == 6
    assert {name: (o["steps"], o["skipped"]) for name, o in rank["optimizers"].items()} == {"AdamW": (5, 1)}
    assert rank["optimizers"]["AdamW"]["latest_nonfinite_parameter"].startswith("generator.")


def test_the_two_optimizer_snippet_gates_the_scheduler_on_real_updates(monkeypatch):
    ns = _run(_snippet(TWO_OPTIMIZERS), monkeypatch, RECIPES)
    summary = ns["watch"].summary()
    assert "gen: 5 stepped, 1 skipped" in summary and "disc: 5 stepped, 1 skipped" in summary, summary
    # The schedule advanced once per real update of gen, not once per iteration.
    assert ns["sched_g"].last_epoch == 5
    assert "0 scheduler steps after a skip" in summary


def test_the_accumulation_snippet_counts_one_step_per_accumulated_batch(monkeypatch):
    summary = _run(_snippet(ACCUMULATION), monkeypatch, RECIPES)["watch"].summary()
    assert summary.startswith("iteration 3,") and ": 2 stepped, 1 skipped" in summary, summary


def test_the_samples_snippet_names_every_micro_batch_of_the_skipped_iteration(monkeypatch):
    ns = _run(_snippet(SAMPLES), monkeypatch, RECIPES)
    (skip,) = [e for e in ns["watch"]._recorder.events.drain() if e["kind"] == "skip"]
    assert skip["iteration"] == 1  # micro-batch 2 holds the inf: the second accumulated step
    assert skip["samples"]["ids"] == list(range(8, 16)) and skip["samples"]["count"] == 8
    assert skip["samples_before"] == [{"iteration": 0, "samples": {"ids": list(range(8)), "count": 8,
                                                                  "digest": samples_digest(range(8))}}]


def test_the_fused_snippet_attaches_to_a_fused_optimizer_and_reports_its_skip(monkeypatch):
    loop = '''
for x, y in loader:
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.float16):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
'''
    ns = _run(_snippet(FUSED) + loop, monkeypatch, RECIPES)
    assert ns["opt"].defaults["fused"] is True
    assert "AdamW: 5 stepped, 1 skipped" in ns["watch"].summary(), ns["watch"].summary()


def test_the_bf16_snippet_watches_without_a_scaler_and_counts_each_poisoned_step(monkeypatch):
    ns = _run(_snippet(BF16), monkeypatch)
    state = ns["watch"].snapshot()
    # Batch 2's inf went into the weights: its step and every later one applied NaN gradients.
    assert state["scaler"]["kind"] == "none" and state["state"]["loss_scale"] is None
    assert state["state"]["optimizers"]["AdamW"]["poisoned_steps"] == 4
    assert "AdamW: 6 stepped, 0 skipped" in ns["watch"].summary()


@pytest.mark.timeout(120)
def test_the_fsdp2_snippet_watches_a_fully_sharded_model(monkeypatch):
    import torch.distributed as dist

    from ampwatch_support.ports import free_port

    loop = _snippet(BF16).split("\n", 3)[3]  # the README's bf16 snippet's loop, after its watch() line
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        ns = _run(_snippet(FSDP2) + loop, monkeypatch, RECIPES)
    finally:
        dist.destroy_process_group()
    assert type(ns["model"].generator.weight).__name__ == "DTensor"  # sharded (one rank here: the whole)
    assert ns["watch"].snapshot()["state"]["optimizers"]["AdamW"]["poisoned_steps"] == 4
    assert ns["watch"].snapshot()["state"]["delivery"]["agent_errors"] == 0


def test_the_checkpoint_snippet_saves_resumes_and_rebinds_without_a_false_transition(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    ns = _run(_snippet(CHECKPOINTS), monkeypatch, RECIPES)
    state = ns["watch"].snapshot()["state"]
    assert state["backoffs"] == 1 and state["growths"] == 0, "the restore was booked as a transition"
    assert state["optimizers"]["SGD"]["skipped"] == 1 and state["optimizers"]["SGD"]["steps"] == 5
    assert ns["watch"]._patch.scaler is ns["scaler"], "rebind did not carry the watch over"


# ----- "Attach to your framework": the same snippets on CPU, fp16 set up as each framework sets it up on a GPU ----

def _framework_snippet(index: int, replacements: dict[str, str]) -> str:
    snippet = _snippets(FRAMEWORKS)[index]
    for old, new in replacements.items():
        assert old in snippet, f"the README snippet no longer holds {old!r}: update this test"
        snippet = snippet.replace(old, new)
    return snippet


def _run_framework(preamble: str, snippet: str, monkeypatch, tmp_path) -> dict:
    for var in ("AMPWATCH_URL", "AMPWATCH_DISABLED", "AMPWATCH_SPOOL_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AMPWATCH_RUN", "readme")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(preamble + snippet, README, "exec"), namespace)
    return namespace


@pytest.mark.filterwarnings("ignore")  # Lightning's advice on dataloader workers
def test_the_lightning_snippet_reports_the_skip_of_a_real_fit(monkeypatch, tmp_path):
    pytest.importorskip("lightning")
    from ampwatch.agent.lightning import AmpWatchCallback
    from ampwatch_support.framework_truth import watch_counts

    preamble = ("import torch\nfrom ampwatch_support.lightning_job import OneOptimizer, data, fp16_plugin\n"
                "torch.manual_seed(0)\nmodel = OneOptimizer(poison={2: (0,)})\ntrain_loader = data()\n")
    # On CPU precision="16-mixed" becomes bf16 without a scaler; Lightning's plugin gives the GPU's fp16 path.
    snippet = _framework_snippet(0, {'precision="16-mixed", max_epochs=10': (
        'accelerator="cpu", plugins=[fp16_plugin(init_scale=1024.0)], max_epochs=1, logger=False, '
        'enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False')})
    ns = _run_framework(preamble, snippet, monkeypatch, tmp_path)
    (callback,) = [c for c in ns["trainer"].callbacks if isinstance(c, AmpWatchCallback)]
    assert callback.watch.closed
    assert watch_counts(callback.watch.snapshot()) == ns["model"].truth.counts()
    assert ns["model"].truth.skipped["SGD"] == 1


@pytest.fixture
def fresh_accelerate():
    pytest.importorskip("accelerate")
    reset_accelerate_state()
    yield
    reset_accelerate_state()


def test_the_hugging_face_snippet_reports_the_skip_of_a_real_training(monkeypatch, tmp_path, fresh_accelerate):
    pytest.importorskip("transformers")
    from ampwatch.agent.transformers import AmpWatchCallback

    preamble = ("import torch\nfrom ampwatch_support.hf_job import CpuFp16Trainer, Examples, Tiny\n"
                "torch.manual_seed(0)\nmodel = Tiny()\ntrain_dataset = Examples(64, poisoned=(20,))\n")
    snippet = _framework_snippet(1, {
        "fp16=True, num_train_epochs=3": ('fp16=True, num_train_epochs=1, use_cpu=True, report_to="none", '
                                          'save_strategy="no", logging_strategy="no", disable_tqdm=True, '
                                          'train_sampling_strategy="sequential"'),
        "trainer = Trainer(": "trainer = CpuFp16Trainer(",  # fp16 as Accelerate sets it up on a GPU
    })
    ns = _run_framework(preamble, snippet, monkeypatch, tmp_path)
    (callback,) = [c for c in ns["trainer"].callback_handler.callbacks if isinstance(c, AmpWatchCallback)]
    assert callback.watch.closed
    summary = callback.watch.summary()
    assert "AdamW: 7 stepped, 1 skipped" in summary, summary  # 8 updates of 8 examples; example 20 holds an inf


def test_the_accelerate_snippet_watches_an_unchanged_loop(monkeypatch, tmp_path, fresh_accelerate):
    preamble = """
import torch
from ampwatch_support.framework_truth import gpu_like_fp16
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.StepLR(opt, 1)
inputs = torch.randn(32, 8)
inputs[9, 0] = float("inf")
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, torch.randn(32, 1)), batch_size=4)
"""
    loop = """
for x, y in loader:
    with accelerator.accumulate(model):
        accelerator.backward(torch.nn.functional.mse_loss(model(x).float(), y))
        opt.step()
        sched.step()
        opt.zero_grad()
watch.close()
"""
    snippet = _framework_snippet(2, {'Accelerator(mixed_precision="fp16")': (
        'gpu_like_fp16(Accelerator(mixed_precision="fp16", cpu=True), init_scale=1024.0)')})
    ns = _run_framework(preamble, snippet + loop, monkeypatch, tmp_path)
    summary = ns["watch"].summary()
    assert "AdamW: 7 stepped, 1 skipped" in summary, summary  # batch 2 holds an inf
    assert "0 scheduler steps after a skip" in summary and ns["sched"].scheduler.last_epoch == 7


# ----- "Run the collector for real": the shell block, as written, in a temporary root ----

@pytest.mark.slow
def test_the_collector_setup_runs_as_written_in_a_fresh_root(tmp_path):
    (block,) = _snippets(COLLECTOR, "bash")
    install = "pip install ./contract ./server"
    assert block.startswith(install), "the block no longer starts by installing: update this test"
    root, port = tmp_path / "root", free_port()
    script = block[block.index("\n") + 1:]  # installed in this venv already; a test does not reach a registry
    script = script.replace("sudo ", "")  # this test's user owns the temporary root
    script = re.sub(r"(?<=[\s=])/(etc|var)/", rf"{root}/\1/", script)  # a fresh machine's folders, under root
    script = script.replace("--host 0.0.0.0", "--host 127.0.0.1").replace("--port 9457", f"--port {port}")
    assert str(root) in script and not re.search(r"(?<=[\s=])/(etc|var)/", script)
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    env = {k: v for k, v in env.items() if not k.startswith("AMPWATCH_SERVER_")}
    shell = subprocess.Popen(["bash", "-euo", "pipefail", "-c", script], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: shell.poll() is not None or _answers(url + "/readyz"), timeout=60)
        assert shell.poll() is None, shell.communicate(timeout=10)[0].decode()
        token = (root / "etc" / "ampwatch" / "ingest-token").read_text().strip()
        assert re.fullmatch(r"[0-9a-f]{64}", token)
        batch = json.dumps(make_batch(run="readme-setup")).encode()
        request = urllib.request.Request(url + "/v1/ingest", data=batch, headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert json.loads(answer.read()) == APPLIED
        for folder in (root / "etc" / "ampwatch", root / "var" / "lib" / "ampwatch"):
            assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
        assert stat.S_IMODE((root / "var" / "lib" / "ampwatch" / "ampwatch.db").stat().st_mode) == 0o600
    finally:
        os.killpg(shell.pid, signal.SIGTERM)
        shell.communicate(timeout=30)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return answer.status == 200
    except OSError:
        return False
