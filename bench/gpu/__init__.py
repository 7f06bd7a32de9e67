"""The GPU check of ampwatch: truth, zero syncs, overhead and inspection on CUDA (``python -m bench.gpu``).

Needs only torch and the agent's source (``PYTHONPATH=agent/src``). This package imports nothing at load
time, so ``bench.report`` can render its results without torch.
"""
