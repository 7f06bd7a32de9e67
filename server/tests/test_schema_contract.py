"""The collector's wire schema, totals, metrics and alert history name only what ``ampwatch.contract.batch`` declares.

The schema ignores fields it does not know (a newer agent's), so a field one side spells differently from the
other passes every batch: these checks compare each side with the contract instead.
"""

from __future__ import annotations

import typing

import msgspec
import pytest

from ampwatch.contract import batch as contract
from ampwatch.contract.counters import COUNTERS, GAUGES
from ampwatch.server import _metrics, _schema
from ampwatch.server._state import RankSnapshot
from ampwatch.server._totals import OptimizerTotals, RankTotals


def _schema_fields(model: type) -> tuple[set[str], set[str]]:
    """Every field ``model`` reads from the wire, and those it requires."""
    infos = msgspec.structs.fields(model)
    return ({f.encode_name for f in infos},
            {f.encode_name for f in infos if f.required})


_PARTS = [(_schema.WireRankState, contract.RankState), (_schema.WireOptimizerCounters, contract.OptimizerCounters),
          (_schema.Delivery, contract.DeliveryCounters), (_schema.ParamDetail, contract.ParamCount)]
_EVENTS = [(model, contract.EVENTS[model.__struct_config__.tag]) for model in typing.get_args(_schema.Event)]


@pytest.mark.parametrize("model, declared", _PARTS + _EVENTS, ids=lambda p: getattr(p, "__name__", ""))
def test_the_schema_reads_and_requires_exactly_the_fields_the_contract_declares(model, declared):
    read, needed = _schema_fields(model)
    stamped = set(contract.STAMPED) if declared in contract.EVENTS.values() else set()
    if stamped:
        read.add("kind")  # the tag: a class variable of the model, the first thing the decoder reads
        needed.add("kind")
    assert read == set(contract.fields(declared)), f"{model.__name__} reads fields the contract does not declare, " \
        "or ignores ones it does: change ampwatch.contract.batch and this schema together"
    assert needed == set(contract.required(declared)) | stamped


def test_every_event_kind_of_the_contract_has_a_model_in_the_schema():
    assert [model.__struct_config__.tag for model, _ in _EVENTS] == list(contract.EVENTS)


def test_the_totals_sum_every_counter_the_contract_declares_and_nothing_else():
    optimizer = set(contract.fields(contract.OptimizerCounters)) - set(contract.OPTIMIZER_GAUGES)
    assert set(OptimizerTotals.__dataclass_fields__) == optimizer
    rank = set(contract.fields(contract.RankState)) - set(contract.RANK_GAUGES) - {"optimizers", "delivery"}
    assert set(RankTotals.__dataclass_fields__) == rank | set(contract.fields(contract.DeliveryCounters))


def test_the_metrics_render_totals_by_the_contracts_names():
    optimizer, rank = set(contract.fields(contract.OptimizerCounters)), set(RankTotals.__dataclass_fields__)
    assert {name for _, name in _metrics._OPTIMIZER_TOTALS} <= optimizer
    assert {name for _, name in _metrics._RANK_TOTALS} <= rank


def test_the_counters_alerts_read_are_counters_the_contract_declares():
    # The alert history reads them by name from a rank's snapshot; ``conflicts`` and ``gradient_outliers`` the
    # collector counts itself, and ``on_suspect_device`` it judges itself (docs/suspects.md).
    sent = {"optimizer": set(contract.fields(contract.OptimizerCounters)),
            "rank": set(contract.fields(contract.RankState)) - {"optimizers", "delivery"}}
    for value in (*COUNTERS.values(), *GAUGES.values()):
        assert value.name in sent[value.per] or (value.per, value.name) in (("rank", "conflicts"),
                                                                           ("rank", "gradient_outliers"),
                                                                           ("rank", "on_suspect_device")), value.name
        if value.per == "optimizer" and value.name in COUNTERS:
            assert value.name in OptimizerTotals.__dataclass_fields__, value.name
        elif value.per == "rank" and value.name in COUNTERS:
            assert value.name in RankTotals.__dataclass_fields__ or value.name in RankSnapshot.__dataclass_fields__
