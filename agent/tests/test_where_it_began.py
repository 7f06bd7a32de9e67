"""``began``: where a skip's or poisoned step's inf/NaN began, found by real parts (docs/agent.md#where-it-began).

The job is ``ampwatch_support.began_job``'s :class:`Tower` (its docstring says where each inf is made and why its
backward order is neither ``named_parameters()`` nor its reverse); a real GradScaler("cpu") under bf16 autocast,
or no scaler with ``watch.loss()``. Every watched run trains bit for bit as its unwatched twin.
"""

from __future__ import annotations

import collections
import copy
import pickle

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ampwatch_support import began_job
from ampwatch_support.began_job import InfGradient, Tower, run
from ampwatch_support.ddp_harness import run_ranks

BACKWARD = {"loss_finite": True, "stage": "backward", "param": "p3.weight", "module": "p3", "module_type": "Linear"}
ARMED = {"loss_finite": False, "stage": "forward", "probe": "armed"}
FOUND = {"loss_finite": False, "stage": "forward", "probe": "found", "module": "spike", "module_type": "Exp"}


def _watch(scaler, opt, model):
    from ampwatch import agent

    return agent.watch(scaler, opt, model=model, collector=(), run="began")


def _twin_of(watched: dict, **job) -> None:
    assert watched["digests"] == run(None, **job)["digests"] and watched["errors"] == 0


@pytest.mark.parametrize(("scaled", "enabled"), [(True, True), (True, False), (False, True)],
                         ids=["grad_scaler", "disabled_scaler", "no_scaler"])
def test_an_inf_made_in_backward_names_the_first_gradient_backward_made_non_finite_not_a_named_order(scaled, enabled):
    job = {"scaled": scaled, "enabled": enabled, "iterations": 4, "backward_at": frozenset({1}), "micro": 2}
    watched = run(_watch, **job)
    scaled = scaled and enabled  # a disabled scaler skips nothing: its steps are checked as without one
    assert watched["events"][0] == [1, "skip" if scaled else "poisoned_step", BACKWARD]
    # A backward start arms no forward probe (without a scaler the poisoned weights make the later losses NaN).
    assert all(hooks == [0, 0] for hooks in watched["hooks"][:None if scaled else 2])
    if scaled:
        assert len(watched["events"]) == 1
    _twin_of(watched, **job)


def test_an_inf_made_in_a_modules_forward_arms_the_probes_then_names_that_module_at_its_next_occurrence():
    job = {"scaled": True, "iterations": 8, "forward_at": frozenset({2, 5}), "micro": 2}
    watched = run(_watch, **job)
    assert watched["events"] == [[2, "skip", ARMED], [5, "skip", FOUND]]
    # One global hook, from the skip of iteration 2 to the one of 5; none on the model's modules, ever.
    assert watched["hooks"] == [[0, 0]] * 2 + [[0, 1]] * 3 + [[0, 0]] * 4
    _twin_of(watched, **job)


def test_without_a_scaler_watch_loss_tells_a_forward_start_and_the_probes_name_the_module_at_the_next_step():
    job = {"scaled": False, "iterations": 3, "forward_at": frozenset({1})}
    watched = run(_watch, **job)
    # The poisoned step's NaN weights make every later forward NaN: the next step names the first module they reach.
    assert watched["events"] == [[1, "poisoned_step", ARMED],
                                 [2, "poisoned_step", {**FOUND, "module": "p1", "module_type": "Linear"}]]
    _twin_of(watched, **job)


class Branch(nn.Module):
    """``main(x) + late(x)``, ``late`` used only once ``use_late`` is set; its gradient made inf when ``fire``."""

    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Linear(8, 4)
        self.late = nn.Linear(8, 4, bias=False)
        self.use_late = self.fire = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.main(x)
        if self.use_late:
            late = self.late(x)
            y = y + (InfGradient.apply(late) if self.fire else late)
        return y


def test_a_parameter_missing_from_the_learned_order_is_not_guessed_and_the_order_is_learned_again():
    from ampwatch import agent

    torch.manual_seed(0)
    net = Branch()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    with agent.watch(scaler, opt, model=net, collector=(), run="began") as w:
        for i in range(5):  # learned at 0 without late; late from 1 on, its gradient inf at 2 and 4
            net.use_late, net.fire = i >= 1, i in (2, 4)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = net(torch.randn(4, 8)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        began = [(e["iteration"], e["began"]) for e in w._recorder.events.drain() if e["kind"] == "skip"]
    assert began == [(2, {"loss_finite": True, "stage": "backward"}),
                     (4, {"loss_finite": True, "stage": "backward", "param": "late.weight", "module": "late",
                          "module_type": "Linear"})]


def test_healthy_training_never_installs_a_forward_hook_and_leaves_no_hook_of_the_order_behind():
    """The order's tensor hooks come off after the first iteration, hook dict and all: a dict left empty on a
    parameter still has autograd call into Python for it at every backward."""
    residue = []

    def hook_dicts(i, net, handle):
        residue.append(sum(p._backward_hooks is not None for p in net.parameters()))

    watched = run(_watch, scaled=True, iterations=4, during=hook_dicts)
    assert watched["events"] == [] and all(hooks == [0, 0] for hooks in watched["hooks"])
    assert residue == [0, 0, 0, 0]


class _Operators(TorchDispatchMode):
    """Count every operator dispatched while ``on``."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.on = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on:
            self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("scaled", [True, False], ids=["grad_scaler", "no_scaler"])
def test_a_healthy_iteration_costs_began_no_operator_with_a_scaler_and_a_detach_per_loss_without(scaled):
    """From the third iteration on (the first one's backward learns the order with hooks, no operator), the watched
    job dispatches what the unwatched one does. Without a scaler, also the existing check of each step's gradients
    (docs/agent.md, jobs without a GradScaler), and a ``detach`` (no kernel) per micro-batch's loss, kept for that
    check."""
    def operators(watch) -> collections.Counter[str]:
        mode = _Operators()

        def from_the_third(i, net, handle):
            mode.on = i >= 1

        with mode:
            run(watch, scaled=scaled, iterations=6, micro=2, during=from_the_third)
        return mode.counts

    bare, watched = operators(None), operators(_watch)
    added = {op: watched[op] - bare[op] for op in set(watched) | set(bare) if watched[op] != bare[op]}
    unscaled = {"aten._amp_foreach_non_finite_check_and_unscale_.default": 4, "aten.detach.default": 4 * 2}
    assert added == ({} if scaled else unscaled)


def test_the_probes_come_off_when_their_window_ends_and_at_close(monkeypatch):
    monkeypatch.setenv("AMPWATCH_PROBE_ITERATIONS", "3")
    watched = run(_watch, scaled=True, iterations=8, forward_at=frozenset({1, 7}))
    # Armed at iteration 1's skip, on for iterations 1-3 (3 iterations), off after: 7's skip arms them again and
    # close() takes them off.
    assert [g for _, g in watched["hooks"]] == [0, 1, 1, 0, 0, 0, 0, 1, 0]
    assert watched["events"] == [[1, "skip", ARMED], [7, "skip", ARMED]]


def test_nothing_of_the_armed_probes_reaches_a_pickle_state_dict_or_deep_copy_of_the_model():
    seen: dict = {}

    def while_armed(i, net, handle):
        if i != 2:
            return
        assert began_job.global_forward_hooks() == 1
        clone = pickle.loads(pickle.dumps(net))
        seen["pickled_hooks"] = began_job.forward_hooks(clone)
        seen["state_dict"] = sorted(net.state_dict()) == sorted(Tower().state_dict())
        probes = handle._recorder.began.probes
        before = len(probes.open)
        twin = copy.deepcopy(net)
        twin(torch.randn(2, 8)).sum().backward()  # the copy's forward is not probed
        seen["copy_noted"] = len(probes.open) - before
        net(torch.randn(2, 8)).sum().backward()  # the model's own is: its 6 modules, itself included
        seen["model_noted"] = len(probes.open) - before
        net.zero_grad(set_to_none=True)

    run(_watch, scaled=True, iterations=4, forward_at=frozenset({1}), during=while_armed)
    assert seen == {"pickled_hooks": 0, "state_dict": True, "copy_noted": 0, "model_noted": 6}


UNAVAILABLE = {"loss_finite": False, "stage": "forward", "probe": "unavailable"}


def test_a_compiled_model_takes_no_probe_and_says_unavailable():
    def compiled(net):
        return torch.compile(net, backend="eager")  # what the graph does is never changed: no hook is put on

    watched = run(_watch, scaled=True, iterations=3, forward_at=frozenset({1}), wrap=compiled)
    assert watched["events"] == [[1, "skip", UNAVAILABLE]]
    assert all(hooks == [0, 0] for hooks in watched["hooks"])


def test_a_forward_compiled_behind_the_watchs_back_is_said_unavailable_once_the_probes_saw_none_of_it():
    """The watch is given the eager model, the job calls it inside a compiled function: the probe notes nothing
    while torch.compile is at work, so the next occurrence finds it saw no forward, says so and takes it off."""
    from ampwatch import agent

    torch.manual_seed(0)
    net = Tower()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)

    @torch.compile(backend="eager")
    def scaled_loss(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return scaler.scale(net(x).float().pow(2).mean())

    with agent.watch(scaler, opt, model=net, collector=(), run="began") as w:
        for i in range(6):
            x = torch.randn(4, 8)
            if i in (1, 3, 5):
                x[0] = began_job.HUGE
            opt.zero_grad(set_to_none=True)
            scaled_loss(x).backward()
            scaler.step(opt)
            scaler.update()
        began = [(e["iteration"], e["began"]) for e in w._recorder.events.drain() if e["kind"] == "skip"]
        assert began_job.global_forward_hooks() == 0
    assert began == [(1, ARMED), (3, UNAVAILABLE), (5, UNAVAILABLE)]


def test_the_disabled_watch_takes_a_loss_and_does_nothing(monkeypatch):
    from ampwatch import agent

    monkeypatch.setenv("AMPWATCH_DISABLED", "1")
    handle = agent.watch(None, torch.optim.SGD(Tower().parameters(), lr=0.1))
    assert handle.loss(torch.tensor(float("inf"))) is None


def test_a_bad_probe_window_is_refused_naming_the_variable():
    from ampwatch.agent._config import AgentConfig

    with pytest.raises(ValueError, match="AMPWATCH_PROBE_ITERATIONS"):
        AgentConfig.from_env(environ={"AMPWATCH_PROBE_ITERATIONS": "-1"})


@pytest.mark.slow
def test_over_real_ddp_only_the_rank_where_it_began_names_its_parameter_or_module(tmp_path):
    ranks = run_ranks("ampwatch_support.began_worker", tmp_path, 2, timeout=240, what="began")
    for rank in ranks:
        for scenario in rank.values():
            assert scenario["watched"]["digests"] == scenario["twin"]["digests"]
            assert scenario["watched"]["errors"] == 0
    elsewhere = {"loss_finite": True, "stage": "backward"}  # finite loss, own gradients finite: nothing named
    assert [r["backward"]["watched"]["events"] for r in ranks] == [[[1, "skip", BACKWARD]], [[1, "skip", elsewhere]]]
    assert [r["forward"]["watched"]["events"] for r in ranks] == [
        [[1, "skip", elsewhere], [3, "skip", elsewhere]], [[1, "skip", ARMED], [3, "skip", FOUND]]]
