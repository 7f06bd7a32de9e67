"""The Lightning integration for the ``pytorch_lightning`` package (same callback as :mod:`ampwatch.agent.lightning`).

``pip install "ampwatch-agent[pytorch-lightning]"``.
"""

from __future__ import annotations

from typing import Any

from ._frameworks import require
from ._lightning import LightningWatch

__all__ = ["AmpWatchCallback"]

_pl = require("pytorch_lightning", integration="ampwatch.agent.pytorch_lightning", extra="pytorch-lightning")


_Callback: Any = _pl.Callback  # a base class mypy cannot see through require()


class AmpWatchCallback(LightningWatch, _Callback):
    __doc__ = LightningWatch.__doc__
