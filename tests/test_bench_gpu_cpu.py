"""The GPU check (``python -m bench.gpu``) on CPU: its smoke run passes, and its comparisons can fail.

No GPU here: the CUDA path of the script is only exercised where one is lent (docs/benchmarks.md, GPU).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What a GPU machine may lack: the collector's and dashboards' dependencies, the dev tools, numpy.
NOT_IMPORTABLE = ("numpy", "accelerate", "fastapi", "starlette", "uvicorn", "pydantic", "prometheus_client",
                  "httpx", "grafanalib", "hypothesis", "pytest", "uvloop", "httptools", "playwright",
                  "ampwatch.server", "ampwatch.dashboards")
RUN_WITH_ONLY_TORCH = (
    "import runpy, sys\n"
    "for name in {blocked!r}:\n"
    "    sys.modules[name] = None  # import fails, importlib.util.find_spec says 'not installed'\n"
    "sys.argv = ['python -m bench.gpu'] + {argv!r}\n"
    "runpy.run_module('bench.gpu', run_name='__main__', alter_sys=True)\n"
)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMPWATCH_") and k != "PYTHONPATH"}
    # The source of the agent, its contract and the sync counter, as on a GPU machine without a venv.
    env["PYTHONPATH"] = os.pathsep.join(["agent/src", "contract/src", "support/src"])
    return env


@pytest.mark.slow
@pytest.mark.timeout(320)
def test_cpu_smoke_run_passes_every_truth_and_sync_check_with_only_torch_importable(tmp_path):
    argv = ["--device", "cpu", "--quick", "--out-dir", str(tmp_path)]
    out = subprocess.run([sys.executable, "-c", RUN_WITH_ONLY_TORCH.format(blocked=NOT_IMPORTABLE, argv=argv)],
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-6000:]
    assert "proves nothing about CUDA" in out.stdout
    results = json.loads((tmp_path / "gpu.json").read_text())
    assert results["device"] == "cpu" and results["passed"] is True
    by_name = {(c["section"], c["name"]): c for c in results["checks"]}
    assert not [c for c in results["checks"] if c["status"] in ("fail", "error")]
    truth = {name: c["status"] for (section, name), c in by_name.items() if section == "truth"}
    assert truth == {"ask-every-step": "pass", "never-ask": "pass", "compiled": "pass", "parameter-names": "pass",
                     "parameter-names-unasked": "info", "poisoned-step-foreach": "pass",
                     "poisoned-step-fused": "pass", "poisoned-step-fused-unasked": "pass",
                     "torch-fused-sgd-momentum": "info"}
    for key in (("syncs", "fused-counted"), ("syncs", "foreach-counted"), ("inspection", "names-at-scale"),
                ("ddp", "two-ranks"), ("began", "began-backward"), ("began", "began-forward"),
                ("began", "began-armed-syncs")):
        assert by_name[key]["status"] == "pass", by_name[key]
    assert by_name[("syncs", "foreach-counted")]["bare"] > 0  # the counter saw the scaler's own reads
    assert by_name[("sync-trace", "all-synchronisations")]["status"] == "skip"
    _assert_fsdp_section(by_name)
    _assert_spikes_section(by_name)
    overhead = [c for c in results["checks"] if c["section"] == "overhead" and "variants" in c]
    assert len(overhead) == 4 and all({"bare", "ampwatch_unasked", "ampwatch", "forum"} <= set(c["variants"])
                                      for c in overhead)
    page = (tmp_path / "gpu.md").read_text()
    assert page.startswith("## GPU") and "proves nothing about CUDA" in page and "| truth | never-ask | pass |" in page


def _assert_spikes_section(by_name: dict) -> None:
    """The spike watch's case ran on CPU (counts as information: no device to wait for; the levels were in the
    state, else it fails) once the agent has issue 40's watch.loss / watch.grad_norm; until then one skip says so."""
    from bench.gpu.spikes import available

    spikes = {name: c for (section, name), c in by_name.items() if section == "spikes"}
    if available():
        assert {name: c["status"] for name, c in spikes.items()} == {
            "spikes-syncs-scaled": "info", "spikes-syncs-bf16": "info", "spikes-overhead-fused": "info",
            "spikes-overhead-foreach": "info"}, spikes
        assert all({"bare", "watched", "spikes"} <= set(spikes[f"spikes-overhead-{kind}"]["variants"])
                   for kind in ("fused", "foreach"))
    else:
        assert list(spikes) == ["spikes"] and spikes["spikes"]["status"] == "skip"
        assert "no watch.loss / watch.grad_norm" in spikes["spikes"]["detail"]


def _assert_fsdp_section(by_name: dict) -> None:
    """torch's FSDP2 and FSDP1 ran on 2 gloo ranks, each exact against its own truth; the frameworks' FSDP
    needs CUDA and says so."""
    from bench.gpu.fsdp import FED_AT, PLANTED_AT, STEPS, UNSCALED_PLANTED_AT

    fsdp = {name: c["status"] for (section, name), c in by_name.items() if section == "fsdp"}
    assert fsdp == {"fsdp2-scaled": "pass", "fsdp2-unscaled": "pass", "fsdp1-orig-params": "pass",
                    "fsdp1-flat-params": "pass", "lightning-fsdp-strategy": "skip", "accelerate-fsdp1": "skip",
                    "accelerate-fsdp2": "skip"}
    for name in ("fsdp2-scaled", "fsdp1-orig-params", "fsdp1-flat-params"):
        ranks = by_name[("fsdp", name)]["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1]
        for r in ranks:  # both ranks skipped the fed and the planted step, and the agent counted exactly that
            assert r["skipped"] == [FED_AT, PLANTED_AT] and r["problems"] == [], (name, r)
            assert (r["agent"]["steps"], r["agent"]["skipped"], r["agent"]["backoffs"]) == (STEPS - 2, 2, 2)
    assert "ShardedGradScaler" in by_name[("fsdp", "fsdp1-flat-params")]["detail"]
    # The planting rank (the last) is poisoned from its plant on; the other from the next all-gather.
    unscaled = by_name[("fsdp", "fsdp2-unscaled")]["ranks"]
    assert [r["poisoned"] for r in unscaled] == [list(range(UNSCALED_PLANTED_AT + 1, STEPS)),
                                                 list(range(UNSCALED_PLANTED_AT, STEPS))]
    assert [r["agent"]["poisoned_steps"] for r in unscaled] == [STEPS - UNSCALED_PLANTED_AT - 1,
                                                               STEPS - UNSCALED_PLANTED_AT]
    for name in ("lightning-fsdp-strategy", "accelerate-fsdp1", "accelerate-fsdp2"):
        assert by_name[("fsdp", name)]["detail"].startswith("needs CUDA"), by_name[("fsdp", name)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the default device is there")
@pytest.mark.timeout(60)
def test_without_a_gpu_the_default_run_exits_2_and_points_to_device_cpu(tmp_path):
    out = subprocess.run([sys.executable, "-m", "bench.gpu", "--out-dir", str(tmp_path)], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=50)
    assert out.returncode == 2 and "--device cpu" in out.stderr
    assert not (tmp_path / "gpu.json").exists()


@pytest.mark.timeout(60)
def test_the_truth_comparison_reports_each_kind_of_disagreement():
    from bench.gpu import truth
    from bench.gpu._amp import Amp
    from bench.gpu._truth import compare

    w = truth._watched(Amp(torch.device("cpu")), truth.NAMES, ask=True)
    assert compare(w.run, truth.NAMES, w.state, w.events) == []

    def problems(state=None, events=None, run=None) -> str:
        return " ".join(compare(run or w.run, truth.NAMES, state or w.state, w.events if events is None else events))

    state = copy.deepcopy(w.state)
    state["optimizers"]["adamw_fused"]["skipped"] += 1
    assert "adamw_fused.skipped: agent 2 != truth 1" in problems(state=state)
    for key, change in (("backoffs", 1), ("growths", 1), ("manual_sets", 1)):
        state = copy.deepcopy(w.state)
        state[key] += change
        assert f"{key}: agent" in problems(state=state)
    state = copy.deepcopy(w.state)
    state["loss_scale"] *= 2
    assert "loss_scale: agent" in problems(state=state)
    skips = [e for e in w.events if e["kind"] == "skip"]
    assert "skip events" in problems(events=[e for e in w.events if e is not skips[0]])
    relabelled = [dict(e, cause="growth") if e["kind"] == "scale_change" else e for e in w.events]
    assert "scale_change events" in problems(events=relabelled)
    run = copy.deepcopy(w.run)
    run.answers[2]["adamw_foreach"] = True  # it skipped there
    assert "stepped() wrong 1 times" in problems(run=run)
    run = copy.deepcopy(w.run)
    run.final_scale *= 2
    assert "ground truth" in problems(run=run)


def test_the_docs_section_says_how_to_run_it_until_a_gpu_run_is_committed():
    from bench.gpu.report import COMMAND, section

    text = "\n".join(section(None))
    assert text.startswith("## GPU") and "Not yet run on a GPU" in text and COMMAND in text
    assert "FSDPStrategy" in text and "Accelerate's FSDP plugin" in text
    assert COMMAND == "PYTHONPATH=agent/src:contract/src:support/src python -m bench.gpu --out-dir $OUT"
