"""ampwatch agent: per-rank, per-optimizer GradScaler skip and loss-scale reporting.

>>> from ampwatch import agent
>>> # watch = agent.watch(scaler, {"gen": opt_g, "disc": opt_d}, model=model)
>>> # watch.stepped(opt_g); watch.close()
"""

from ._watch import DisabledWatch, Watch, watch

__all__ = ["DisabledWatch", "Watch", "watch"]
