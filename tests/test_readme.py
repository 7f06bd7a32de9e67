"""The README's agent snippets run as written (on CPU) and report what they claim, one through a real collector."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
from collector_process import CollectorProcess


README = Path(__file__).resolve().parents[1] / "README.md"

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
loss_fn = lambda out, y: nn.functional.mse_loss(out.float(), y)
opt_g = torch.optim.AdamW(model.generator.parameters(), lr=1e-3)
opt_d = torch.optim.SGD(model.critic.parameters(), lr=1e-2)
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
sched_g = torch.optim.lr_scheduler.StepLR(opt_g, step_size=1)
scaler = torch.amp.GradScaler("cpu")
accumulation = 2
'''


def _snippets() -> list[str]:
    text = README.read_text()
    section = text[text.index("## Attach the agent"):text.index("## Run the collector")]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def _run(snippet: str, monkeypatch) -> dict:
    monkeypatch.delenv("AMPWATCH_URL", raising=False)
    monkeypatch.setenv("AMPWATCH_RUN", "readme")
    # This machine has no GPU: the same code on CPU, with CPU autocast's half type.
    code = snippet.replace('"cuda"', '"cpu"').replace("torch.float16", "torch.bfloat16")
    namespace: dict = {}
    exec(compile(PREAMBLE + code, "README.md", "exec"), namespace)
    namespace["watch"].close()
    return namespace


def test_the_readme_shows_five_agent_snippets():
    assert len(_snippets()) == 5


@pytest.mark.timeout(120)
def test_the_plain_loop_snippet_reports_its_skip_to_a_real_collector(tmp_path, monkeypatch):
    with CollectorProcess(str(tmp_path / "ampwatch.db")) as collector:
        snippet = _snippets()[0].replace("http://127.0.0.1:9457", collector.url)
        _run(snippet, monkeypatch)
        with urllib.request.urlopen(collector.url + "/v1/runs/exp-42", timeout=5) as answer:
            (rank,) = json.loads(answer.read())["ranks"]
    assert rank["closed"] and rank["iteration"] == 6
    assert {name: (o["steps"], o["skipped"]) for name, o in rank["optimizers"].items()} == {"AdamW": (5, 1)}
    assert rank["optimizers"]["AdamW"]["latest_nonfinite_parameter"].startswith("generator.")


def test_the_two_optimizer_snippet_gates_the_scheduler_on_real_updates(monkeypatch):
    ns = _run(_snippets()[1], monkeypatch)
    summary = ns["watch"].summary()
    assert "gen: 5 stepped, 1 skipped" in summary and "disc: 5 stepped, 1 skipped" in summary, summary
    # The schedule advanced once per real update of gen, not once per iteration.
    assert ns["sched_g"].last_epoch == 5
    assert "0 scheduler steps after a skip" in summary


def test_the_accumulation_snippet_counts_one_step_per_accumulated_batch(monkeypatch):
    summary = _run(_snippets()[2], monkeypatch)["watch"].summary()
    assert summary.startswith("iteration 3,") and ": 2 stepped, 1 skipped" in summary, summary


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
    ns = _run(_snippets()[3] + loop, monkeypatch)
    assert ns["opt"].defaults["fused"] is True
    assert "AdamW: 5 stepped, 1 skipped" in ns["watch"].summary(), ns["watch"].summary()


def test_the_checkpoint_snippet_saves_resumes_and_rebinds_without_a_false_transition(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    ns = _run(_snippets()[4], monkeypatch)
    state = ns["watch"].snapshot()["state"]
    assert state["backoffs"] == 1 and state["growths"] == 0, "the restore was booked as a transition"
    assert state["optimizers"]["SGD"]["skipped"] == 1 and state["optimizers"]["SGD"]["steps"] == 5
    assert ns["watch"]._patch.scaler is ns["scaler"], "rebind did not carry the watch over"
