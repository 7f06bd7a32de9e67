"""AgentConfig: AMPWATCH_* variables, explicit arguments winning, clear errors, a run placed on one collector."""

from __future__ import annotations

import doctest
import inspect
import pathlib
import re

import pytest

from ampwatch.agent import _config
from ampwatch.agent._config import AgentConfig
from ampwatch.agent._schedule import default_heartbeat
from ampwatch.contract import placement
from ampwatch_support.delivery_harness import make_sender


def test_every_variable_is_read_from_the_environment():
    config = AgentConfig.from_env(environ={
        "AMPWATCH_URL": "http://a:9457/, http://b:9457", "AMPWATCH_RUN": "exp-42", "AMPWATCH_TOKEN": "t",
        "AMPWATCH_PUSH_INTERVAL": "2.5", "AMPWATCH_SPOOL_DIR": "/tmp/spool", "AMPWATCH_SPOOL_MAX_BYTES": "1000",
        "AMPWATCH_TIMEOUT": "3", "AMPWATCH_MAX_BACKOFF": "10", "AMPWATCH_CLOSE_TIMEOUT": "0",
        "AMPWATCH_MAX_EVENTS": "50", "AMPWATCH_DISABLED": "0"})
    assert config.collectors == ("http://a:9457", "http://b:9457")
    assert (config.run, config.token, config.push_interval, config.spool_dir) == ("exp-42", "t", 2.5, "/tmp/spool")
    assert (config.spool_max_bytes, config.timeout, config.max_backoff, config.close_timeout) == (1000, 3, 10, 0)
    assert config.max_events == 50 and config.disabled is False and config.sends is True


def test_explicit_arguments_win_over_the_environment():
    env = {"AMPWATCH_URL": "http://env:1", "AMPWATCH_RUN": "env-run", "AMPWATCH_TOKEN": "env",
           "AMPWATCH_PUSH_INTERVAL": "9", "AMPWATCH_SPOOL_DIR": "/env"}
    config = AgentConfig.from_env(collector=["http://arg:1"], run="arg-run", token="arg", push_interval=0.5,
                                  spool_dir="/arg", environ=env)
    assert (config.collectors, config.run, config.token, config.push_interval, config.spool_dir) == (
        ("http://arg:1",), "arg-run", "arg", 0.5, "/arg")


def test_without_a_collector_the_agent_records_but_does_not_send():
    config = AgentConfig.from_env(environ={})
    assert config.collectors == () and config.sends is False


@pytest.mark.parametrize("value", ["1", "true", "YES", "on"])
def test_ampwatch_disabled_accepts_the_usual_true_spellings(value):
    config = AgentConfig.from_env(environ={"AMPWATCH_DISABLED": value, "AMPWATCH_URL": "http://a:1"})
    assert config.disabled is True and config.sends is False


@pytest.mark.parametrize(("env", "message"), [
    ({"AMPWATCH_PUSH_INTERVAL": "soon"}, "AMPWATCH_PUSH_INTERVAL must be a number"),
    ({"AMPWATCH_PUSH_INTERVAL": "0"}, "AMPWATCH_PUSH_INTERVAL / push_interval= must be a positive"),
    ({"AMPWATCH_TIMEOUT": "-1"}, "AMPWATCH_TIMEOUT"),
    ({"AMPWATCH_MAX_BACKOFF": "nan"}, "AMPWATCH_MAX_BACKOFF"),
    ({"AMPWATCH_CLOSE_TIMEOUT": "-2"}, "AMPWATCH_CLOSE_TIMEOUT must be >= 0"),
    ({"AMPWATCH_SPOOL_MAX_BYTES": "1.5"}, "AMPWATCH_SPOOL_MAX_BYTES must be an integer"),
    ({"AMPWATCH_MAX_EVENTS": "0"}, "AMPWATCH_MAX_EVENTS must be a positive integer"),
    ({"AMPWATCH_DISABLED": "maybe"}, "AMPWATCH_DISABLED must be one of"),
    ({"AMPWATCH_URL": "127.0.0.1:9457"}, "AMPWATCH_URL / collector= must be http(s)://host[:port]"),
    ({"AMPWATCH_URL": "http://a:notaport"}, "bad port"),
    ({"AMPWATCH_RUN": "a\nb"}, "AMPWATCH_RUN / run= must be 1-128 printable"),
])
def test_a_bad_value_raises_a_value_error_naming_the_variable(env, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        AgentConfig.from_env(environ=env)


def test_every_rank_of_a_run_reports_to_the_collector_that_ranks_first_for_the_run():
    urls = [f"http://c{i}:9457" for i in range(3)]
    config = AgentConfig.from_env(collector=urls, environ={})
    # The same collectors in another order, with a trailing "/" or a host in capitals: the same placement.
    again = AgentConfig.from_env(collector="http://C2:9457/," + ",".join(reversed(urls)), environ={})
    first = {}
    for run in (f"exp-{i}" for i in range(300)):
        held = {config.collector_for(run, rank, 64) for rank in range(64)}
        assert held == {placement.ranking(run, urls)[0]}, f"run {run} split over {held}"
        assert again.collector_for(run, 63, 64) == config.collector_for(run, 63, 64)
        first[run] = held.pop()
    counts = [list(first.values()).count(url) for url in urls]
    assert min(counts) > 60, f"300 runs should spread over 3 collectors, got {counts}"


@pytest.mark.parametrize(("block_ranks", "world_size", "expected"), [
    # a run of at most a block: whole on its first collector; a bigger one in blocks, block b on its b % n-th
    (2, 2, [0, 0]),
    (2, 5, [0, 0, 1, 1, 2]),
    (1, 4, [0, 1, 2, 0]),
    (placement.BLOCK_RANKS, 4, [0, 0, 0, 0]),
])
def test_a_run_of_more_than_ampwatch_block_ranks_goes_to_the_collectors_in_contiguous_blocks(block_ranks, world_size,
                                                                                             expected):
    urls = [f"http://c{i}:9457" for i in range(3)]
    config = AgentConfig.from_env(collector=urls, environ={"AMPWATCH_BLOCK_RANKS": str(block_ranks)})
    order = placement.ranking("big-run", urls)
    assert [config.collector_for("big-run", rank, world_size) for rank in range(world_size)] == [
        order[i] for i in expected]


def test_ampwatch_block_ranks_is_read_from_the_environment_and_defaults_to_the_contracts_block():
    assert AgentConfig.from_env(environ={}).block_ranks == placement.BLOCK_RANKS == 4_096
    assert AgentConfig.from_env(environ={"AMPWATCH_BLOCK_RANKS": " 8192 "}).block_ranks == 8192
    assert AgentConfig.from_env(environ={"AMPWATCH_BLOCK_RANKS": "4096"}, block_ranks=2).block_ranks == 2


@pytest.mark.parametrize(("setting", "message"), [
    ({"environ": {"AMPWATCH_BLOCK_RANKS": "many"}}, "AMPWATCH_BLOCK_RANKS must be an integer, got 'many'"),
    ({"environ": {"AMPWATCH_BLOCK_RANKS": "1.5"}}, "AMPWATCH_BLOCK_RANKS must be an integer"),
    ({"environ": {"AMPWATCH_BLOCK_RANKS": "0"}}, "AMPWATCH_BLOCK_RANKS / block_ranks= must be a whole number of "
                                                "ranks >= 1, got 0"),
    ({"environ": {"AMPWATCH_BLOCK_RANKS": "-8"}}, "AMPWATCH_BLOCK_RANKS / block_ranks= must be a whole number"),
    ({"environ": {}, "block_ranks": True}, "AMPWATCH_BLOCK_RANKS / block_ranks= must be a whole number"),
    ({"environ": {}, "block_ranks": 2.0}, "AMPWATCH_BLOCK_RANKS / block_ranks= must be a whole number"),
])
def test_a_bad_ampwatch_block_ranks_raises_a_value_error_saying_what_is_accepted(setting, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        AgentConfig.from_env(**setting)


def test_the_default_push_interval_follows_the_ranks_each_collector_serves():
    config = AgentConfig.from_env(collector="http://a:1", environ={})
    assert config.push_interval is None  # not set: resolved once the job's size is known
    assert config.for_job(8).push_interval == 15.0
    assert config.for_job(10_000).push_interval == pytest.approx(20.0)
    assert config.for_job(16_384).push_interval == 30.0  # 32.8 s would do: the longest default is 30 s
    two = AgentConfig.from_env(collector="http://a:1,http://b:2", environ={})
    assert two.for_job(16_384).push_interval == pytest.approx(16.384)  # 8,192 ranks on each collector
    assert two.for_job(4_000).push_interval == 15.0  # a run of one block: 4,000 on one collector, under 7,500
    assert AgentConfig.from_env(environ={}).for_job(100_000).push_interval == 30.0


@pytest.mark.parametrize(("collectors", "block_ranks", "world_size", "held"), [
    (0, 8_192, 10_000, 10_000),  # no collector: the job's size
    (1, 4_096, 10_000, 10_000),  # one collector holds every block
    (2, 8_192, 8_000, 8_000),  # a run of one block lives whole on one of two
    (2, 8_192, 10_000, 8_192),  # blocks of 8,192 and 1,808 ranks, one on each
    (2, 8_192, 16_384, 8_192),  # two blocks, one on each
    (2, 8_192, 20_000, 8_192 + 3_616),  # blocks 0 and 2 on the run's first collector
    (3, 8_192, 20_000, 8_192),
])
def test_the_default_heartbeat_follows_the_most_ranks_of_the_job_one_collector_holds(collectors, block_ranks,
                                                                                      world_size, held):
    config = AgentConfig.from_env(collector=[f"http://c{i}:9457" for i in range(collectors)],
                                  block_ranks=block_ranks, environ={})
    assert config.ranks_per_collector(world_size) == held
    assert config.for_job(world_size).push_interval == pytest.approx(default_heartbeat(held))


def test_an_explicit_push_interval_is_kept_whatever_the_job_size():
    env = AgentConfig.from_env(collector="http://a:1", environ={"AMPWATCH_PUSH_INTERVAL": "15"})
    assert env.for_job(16_384).push_interval == 15.0
    assert AgentConfig.from_env(push_interval=2.0, environ={}).for_job(16_384).push_interval == 2.0


def test_a_sender_of_a_big_job_heartbeats_on_the_job_sized_interval():
    sender, _ = make_sender(None, rank=3, world_size=16_384, push_interval=None)
    try:
        assert sender.config.push_interval == 30.0
        assert sender._schedule.heartbeat == 30.0
    finally:
        sender.close(1.0)


def test_the_examples_in_the_configs_docstrings_hold():
    assert doctest.testmod(_config).failed == 0


def test_every_variable_the_config_reads_has_a_row_in_the_settings_table_of_the_agent_page():
    read = set(re.findall(r'"(AMPWATCH_[A-Z_]+)"', inspect.getsource(AgentConfig.from_env)))
    page = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "agent.md").read_text()
    rows = set(re.findall(r"^\| `(AMPWATCH_[A-Z_]+)` \|", page, flags=re.M))
    assert "AMPWATCH_BLOCK_RANKS" in read
    assert read - rows == set(), "docs/agent.md, Settings, has no row for these"
