"""Render the benchmark results (one JSON document) as ``docs/benchmarks.md``: a module per section.

``render`` builds the page (``page``); each section's tables, and its rows of the summary table, come from
the module named after it, so a section is changed in one place; the cell formats they share from ``_format``.
"""

from bench.report.page import BEFORE_AFTER, render

__all__ = ["render", "BEFORE_AFTER"]
