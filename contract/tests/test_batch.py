"""The batch contract's derived lists agree with its types."""

from __future__ import annotations

from typing import get_type_hints

from ampwatch.contract.batch import OPTIMIZER_LEVELS, RANK_LEVELS, OptimizerCounters, RankState, SignalLevel


def test_the_level_lists_name_exactly_the_signal_level_fields_of_the_state_and_of_an_optimizer():
    def levels(part: type) -> tuple[str, ...]:
        return tuple(name for name, kind in get_type_hints(part).items() if kind is SignalLevel)

    assert RANK_LEVELS == levels(RankState) == ("loss",)
    assert OPTIMIZER_LEVELS == levels(OptimizerCounters) == ("grad_norm", "local_grad_norm")
