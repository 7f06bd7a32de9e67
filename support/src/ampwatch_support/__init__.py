"""What ampwatch's tests, benchmarks and demo share, imported as ``ampwatch_support.<module>``.

Not part of the product: nothing under ``contract/``, ``agent/``, ``server/`` or ``dashboards/`` imports it.
Importing this package imports nothing; each module pulls in only what it needs.

- the collector and its neighbours as real processes: ``collector_process``, ``prometheus_stack``,
  ``webhook_receiver``, ``recording_collector``, ``headless_browser``; ``ports`` (free loopback ports)
- batches and ranks: ``batches`` (the one batch builder, from the contract), ``alert_ranks``, ``staged_job``,
  ``rank_processes`` + ``fault_training`` (ranks as real processes), ``delivery_harness``, ``exposition``
- training jobs and their ground truth: ``framework_truth``, ``lightning_job``, ``hf_job``
- host-device syncs: ``syncs`` (``SyncCounter``); wide bodies and peak memory: ``wide_body``
- time: ``patience`` (deadlines stretched under a loaded machine, ``wait_until``)
"""
