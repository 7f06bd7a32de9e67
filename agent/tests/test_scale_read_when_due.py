"""The loss scale where it cannot reach the host without a sync: read only when a transition is due.

On a device other than CPU and CUDA (no asynchronous copy), or with a torch whose GradScaler keeps no
``_scale`` tensor (the public ``get_scale()`` then, which syncs), the agent reads the scale only after a
skip, a manual ``update(new_scale)``, or every ``growth_interval`` clean iterations since the last growth
or backoff, when the scaler may grow. So it must count those clean iterations as the scaler does, from
the scaler's own growth tracker when it is restored from a checkpoint. No such device here: the scaler is
real and the agent is made to take that path as it does on a torch without ``GradScaler._scale``.
"""

from __future__ import annotations

import torch


def test_a_restore_takes_the_checkpoint_s_growth_tracker_so_each_growth_is_read_in_its_own_iteration(
        amp, watching, events, monkeypatch):
    from ampwatch.agent import _device

    monkeypatch.setattr(_device, "scale_tensor", lambda scaler: None)  # the scale is read only when due
    model = amp.TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", growth_interval=3)
    w = watching(scaler, opt, model=model)
    amp.iteration(model, scaler, [opt], torch.randn(4, 8))  # iteration 0: one clean iteration counted
    checkpoint = torch.amp.GradScaler("cpu", growth_interval=3).state_dict()
    scaler.load_state_dict({**checkpoint, "scale": 256.0, "_growth_tracker": 2})  # two clean since its growth
    scales = {}  # the truth: the scaler's own scale after each iteration
    for iteration in range(1, 6):
        amp.iteration(model, scaler, [opt], torch.randn(4, 8))
        scales[iteration] = scaler.get_scale()
    assert scales == {1: 512.0, 2: 512.0, 3: 512.0, 4: 1024.0, 5: 1024.0}
    growths = [(e["iteration"], e["before"], e["after"]) for e in events(w)
               if e["kind"] == "scale_change" and e["cause"] == "growth"]
    assert growths == [(1, 256.0, 512.0), (4, 512.0, 1024.0)]
    state = w.snapshot()["state"]
    assert (state["growths"], state["backoffs"], state["loss_scale"]) == (2, 0, 1024.0)
