"""What the integrations share to record sample ids without a call: the framework's loader, followed by position.

Lightning and the Hugging Face Trainer fetch batches ahead of the one they train on (Lightning one ahead, to
know the last; the Trainer every micro-batch of an update at once, through Accelerate's loader that is one
ahead again), so a batch is not the iteration's when the loader yields it. Each says which batch of the epoch
it trains on (Lightning's ``batch_idx``; the Trainer's updates times its accumulation), and the ``k``-th batch
of an epoch holds the ``k``-th index list its sampler drew: :meth:`BatchPositions.trained` takes those ids.
A loader that cannot be followed (not a torch DataLoader, ``in_order=False``, several loaders at once) gives
each batch its position instead, ``r<rank>:e<epoch>:b<batch>`` (docs/agent.md#which-batch).
"""

from __future__ import annotations

import logging
from typing import Any

from ._loader import LoaderTap
from ._watch import DisabledWatch, Watch

__all__ = ["BatchPositions"]

log = logging.getLogger("ampwatch.agent")


class BatchPositions:
    """Follow a framework's training loader; record the ids of each batch it trains on, given its position."""

    def __init__(self, framework: str) -> None:
        self.framework = framework
        self.tap: LoaderTap | None = None
        self.loader: Any = None
        self._said = False

    def follow(self, watch: Watch | DisabledWatch | None, loader: Any) -> None:
        """Follow ``loader`` from now on (a framework that makes a new one per epoch: call it each epoch)."""
        if not isinstance(watch, Watch) or watch.closed or loader is self.loader:
            return
        self.close()
        self.loader = loader
        try:
            self.tap = watch._follow(loader, by_position=True)
        except (TypeError, ValueError) as error:
            if not self._said:
                self._said = True
                log.info("ampwatch: %s: each batch's sample ids are its position (rank, epoch, batch), not the "
                         "sampler's indices: %s", self.framework, error)
        except Exception as error:  # noqa: BLE001 - training goes on without sample ids
            watch._recorder.internal_error("following the training loader", error)

    def trained(self, watch: Watch | DisabledWatch | None, position: int, epoch: int) -> None:
        """Record the ids of the batch at ``position`` in ``epoch``, the one about to be trained on."""
        if not isinstance(watch, Watch) or watch.closed:
            return
        try:
            if self.tap is not None:
                self.tap.take(position)
            else:
                watch.batch(f"r{watch._sender.identity.rank}:e{epoch}:b{position}")
        except Exception as error:  # noqa: BLE001 - training goes on without sample ids
            watch._recorder.internal_error("recording a batch's sample ids", error)

    def close(self) -> None:
        """Stop following (the watch's close() stops it too)."""
        if self.tap is not None:
            self.tap.close()
        self.tap = self.loader = None
