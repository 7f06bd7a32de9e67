"""What the ampwatch agent, collector and dashboards agree on, written once (standard library only).

- :mod:`ampwatch.contract.protocol`: the wire protocol's version, limits, streak ladder, counter names
  and a collector's default limits (docs/protocol.md).
- :mod:`ampwatch.contract.batch`: what a batch's ``state`` and each event kind hold, field by field (typed).
- :mod:`ampwatch.contract.metrics`: every series the collector exposes (docs/metrics.md).
- :mod:`ampwatch.contract.thresholds`: the alert thresholds and their profiles (``default``, ``demo``).
- :mod:`ampwatch.contract.counters`: the rank counters and gauges alert conditions read, by name.
- :mod:`ampwatch.contract.alerts`: each alert once: name, severities, ``for`` window, the thresholds its
  condition reads, the window and counters it compares, summary and description, runbook anchor (docs/alerts.md).
- :mod:`ampwatch.contract.placement`: which collector a rank reports to (a run on one replica, a big run in
  blocks of ranks), computed alike by every rank and every collector.
- :mod:`ampwatch.contract.conditions`: the forms a common alert's condition takes (a counter rose, rose by at
  least, a share, a gauge outside a range), which both evaluators compile.

Importing any of them costs a few dataclasses and tuples; nothing here does I/O.
"""
