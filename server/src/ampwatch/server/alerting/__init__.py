"""The collector's built-in alerts, one job per module.

- ``rank_conditions`` and ``run_conditions``: when each alert holds, one function per alert, of one rank or judged
  across a run, from per-rank snapshots and histories (as the Prometheus rules compute it);
- ``conditions``: the pass over both, each rank read once, the per-rank alerts a run-wide one speaks for held back;
- ``annotations``: each alert's summary, description and runbook link, filled in for one instance;
- ``states``: the state machine: pending, firing (after ``for``), resolved;
- ``history``: :class:`~.history.RankHistory`, the counters of one rank's recent past the windows read, laid out
  from the alert definitions (:class:`~.history.HistoryLayout`);
- ``evaluator``: :class:`~.evaluator.BuiltinAlerts`, rank histories + conditions + states, thread-safe;
- ``thresholds``: the ``--alert-thresholds`` value: a profile or a JSON file of overrides;
- ``alert``: :class:`~.alert.Alert`, one firing or resolved alert;
- ``notifications``: targets and the background delivery to them; ``payloads``: the bodies they get;
- ``grouping``: :class:`~.grouping.AlertGroups`, webhook/Slack notifications grouped by alert and run, paced;
- ``service``: :class:`~.service.AlertService`, the evaluator and notifier of one running collector;
- ``route``: ``GET /v1/alerts``.

What an alert is (name, severities, ``for``, texts, the window and counters it reads) is defined once in
``ampwatch.contract.alerts``.
"""
