"""The GPU check of ampwatch: truth, zero syncs, overhead and inspection on CUDA (``python -m bench.gpu``).

Needs only torch and the source of the agent, its contract and the sync counter
(``PYTHONPATH=agent/src:contract/src:support/src``). This package imports nothing at load time, so
``bench.report`` can render its results without torch.
"""
