"""Hand-run benchmarks, not part of ``make bench``: before/after comparisons with an earlier commit and long
capacity runs (``python -m bench --list`` names them; ``bench/README.md``). Their stored results are in
``results/``."""
