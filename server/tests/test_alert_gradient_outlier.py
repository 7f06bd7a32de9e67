"""The built-in AmpRankGradientOutlier, a common alert of scope host: one rank's alert, judged on its own counter at
the batch that carries it, labelled with its host and local rank as the rule labels it from ampwatch_rank_info."""

from __future__ import annotations

from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS as T
from ampwatch.server.alerting.evaluator import BuiltinAlerts
from ampwatch_support.alert_ranks import healthy_job, names

OUTLIER = "AmpRankGradientOutlier"


def test_a_gradient_outlier_fires_at_its_ranks_batch_with_host_and_local_rank_and_resolves_at_one_after_the_window():
    alerts = BuiltinAlerts(T)
    ranks = healthy_job(alerts, 12)  # rank 9 runs on node-1, local rank 1
    ranks[9].outliers += 1  # the collector judged rank 9's own gradient norm to stand out
    ranks[9].iterate()
    fired = [a for a in ranks[9].send(10.0) if a.name == OUTLIER]
    assert [(a.status, dict(a.labels)) for a in fired] == [
        ("firing", {"run": "exp", "rank": "9", "host": "node-1", "local_rank": "1", "severity": "warning"})]
    assert fired[0].value == 1
    assert "Rank 9 of run exp (host node-1, local rank 1)" in fired[0].annotations["description"]
    for r in ranks:  # the other ranks' batches and a pass neither fire it elsewhere nor resolve it
        r.iterate()
        assert names(r.send(20.0), OUTLIER) == []
    assert names(alerts.evaluate(21.0), OUTLIER) == []
    assert [a.labels["rank"] for a in alerts.firing() if a.name == OUTLIER] == ["9"]
    # The rank's first batch past the window resolves it, as one rank's alert: no pass needed.
    ranks[9].iterate()
    assert names(ranks[9].send(10.0 + T.outlier_window_s + 1), OUTLIER) == [(OUTLIER, "resolved", "warning")]
