"""Lightning integration: ``Trainer(callbacks=[AmpWatchCallback()])`` reports every skipped step of a fit.

>>> from ampwatch.agent.lightning import AmpWatchCallback            # doctest: +SKIP
>>> trainer = lightning.pytorch.Trainer(precision="16-mixed", callbacks=[AmpWatchCallback()])  # doctest: +SKIP

``pip install "ampwatch-agent[lightning]"``. For the ``pytorch_lightning``
package, import the same callback from :mod:`ampwatch.agent.pytorch_lightning`.
What it hooks and how it behaves on resume: docs/integrations.md.
"""

from __future__ import annotations

from typing import Any

from ._frameworks import require
from ._lightning import LightningWatch

__all__ = ["AmpWatchCallback"]

_pl = require("lightning.pytorch", integration="ampwatch.agent.lightning", extra="lightning")


_Callback: Any = _pl.Callback  # a base class mypy cannot see through require()


class AmpWatchCallback(LightningWatch, _Callback):
    __doc__ = LightningWatch.__doc__
