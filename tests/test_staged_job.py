"""The staged 1,024-rank job the page tests drive: a storm starts on every rank at the same iteration."""

from ampwatch_support.staged_job import StagedJob


def _first_skip_iterations(batches) -> set[int]:
    return {e["iteration"] for b in batches for e in b["events"] if e["kind"] == "skip"}


def test_a_storm_called_while_a_tick_is_built_starts_on_every_rank_at_the_next_tick():
    job = StagedJob("http://127.0.0.1:1", ranks=64)  # never sent: only the batches are read
    build = job.batch

    def storm_midway(r, storming):  # the test's thread calls storm() while the sender builds this tick
        if r.rank == 32:
            job.storm()
        return build(r, storming)

    job.batch = storm_midway
    storming, batches = job.next_tick()
    assert not storming and _first_skip_iterations(batches) == set()
    job.batch = build
    storming, batches = job.next_tick()
    assert storming and len(batches) == 64
    assert _first_skip_iterations(batches) == {job.per_tick + 1}  # every rank's streak starts at one iteration
    assert all(e["streak"] == 1 for b in batches for e in b["events"] if e["kind"] == "skip")
    assert sum(e["kind"] == "skip" for b in batches for e in b["events"]) == 64 * 2  # both optimizers, each rank
