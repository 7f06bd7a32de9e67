"""Benchmarks of ampwatch (``make bench``, i.e. ``python -m bench``)."""
