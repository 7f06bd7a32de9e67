"""Render the benchmark results (one JSON document) as ``docs/benchmarks.md``: a module per section.

``render`` builds the page (``page``); each section's tables come from the module named after it, and the
cell formats they share from ``_format``.
"""

from bench.report.page import BEFORE_AFTER, render

__all__ = ["render", "BEFORE_AFTER"]
