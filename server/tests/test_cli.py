"""The command line: --help explains options and their env variables; env and flags configure; bad values explain."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ampwatch.contract.placement import BLOCK_RANKS
from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS
from ampwatch.server.__main__ import build_parser
from ampwatch.server._config import config_from_args


def test_help_names_every_option_with_its_environment_variable():
    out = subprocess.run([sys.executable, "-m", "ampwatch.server", "--help"], capture_output=True, text=True,
                         timeout=60).stdout
    for option in ("--host", "--port", "--db", "--token", "--expire-after", "--run-retention", "--db-retention"):
        assert option in out
        assert "AMPWATCH_SERVER_" + option[2:].replace("-", "_").upper() in out
    assert "[serve]" in out and "9457" in out


def test_environment_variables_configure_and_flags_win(monkeypatch):
    monkeypatch.setenv("AMPWATCH_SERVER_PORT", "9999")
    monkeypatch.setenv("AMPWATCH_SERVER_TOKEN", "abc")
    config = config_from_args(build_parser().parse_args([]))
    assert (config.port, config.token) == (9999, "abc")
    config = config_from_args(build_parser().parse_args(["--port", "9458"]))
    assert config.port == 9458


def test_bad_values_say_which_option_and_variable_to_fix(monkeypatch):
    monkeypatch.setenv("AMPWATCH_SERVER_EXPIRE_AFTER", "soon")
    with pytest.raises(ValueError, match="--expire-after / AMPWATCH_SERVER_EXPIRE_AFTER='soon' is not a valid float"):
        config_from_args(build_parser().parse_args([]))
    monkeypatch.delenv("AMPWATCH_SERVER_EXPIRE_AFTER")
    with pytest.raises(ValueError, match="expire_after=1.0 must be >= silent_after.*--expire-after"):
        config_from_args(build_parser().parse_args(["--expire-after", "1", "--silent-after", "5"]))
    result = subprocess.run([sys.executable, "-m", "ampwatch.server", "serve", "--max-runs", "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "max_runs=0 must be >= 1" in result.stderr


def test_silent_after_follows_the_silence_alerts_threshold_unless_given(monkeypatch, tmp_path):
    monkeypatch.delenv("AMPWATCH_SERVER_SILENT_AFTER", raising=False)
    assert config_from_args(build_parser().parse_args([])).silent_after == DEFAULT_THRESHOLDS.silent_after_s
    overrides = tmp_path / "thresholds.json"
    overrides.write_text('{"silent_after_s": 45}')
    assert config_from_args(build_parser().parse_args(["--alert-thresholds", str(overrides)])).silent_after == 45
    given = build_parser().parse_args(["--alert-thresholds", str(overrides), "--silent-after", "7"])
    assert config_from_args(given).silent_after == 7
    monkeypatch.setenv("AMPWATCH_SERVER_SILENT_AFTER", "")  # set but empty: not set
    assert config_from_args(build_parser().parse_args([])).silent_after == DEFAULT_THRESHOLDS.silent_after_s


def _parsed(*argv: str):
    return config_from_args(build_parser().parse_args(list(argv)))


def test_peers_are_read_as_the_agents_url_list_and_this_collector_is_found_in_them():
    config = _parsed("--port", "9458", "--peers", "http://A:9457/, http://b:9458,http://a:9457")
    assert config.peers == ("http://a:9457", "http://b:9458") and config.advertise_url == "http://b:9458"
    config = _parsed("--port", "9457", "--peers", "http://a:9457,http://b:9457", "--advertise-url", "http://B:9457/")
    assert config.advertise_url == "http://b:9457"
    assert _parsed().peers == () and _parsed().advertise_url is None and _parsed().block_ranks == BLOCK_RANKS


@pytest.mark.parametrize("argv, message", [
    (["--peers", "c1:9457"], "must be http\\(s\\)://host\\[:port\\] URLs"),
    (["--port", "1", "--peers", "http://a:9457,http://b:9457"], "0 have port 1\\): give --advertise-url"),
    (["--port", "9457", "--peers", "http://a:9457,http://b:9457"], "2 have port 9457\\): give --advertise-url"),
    (["--peers", "http://a:9457", "--advertise-url", "http://c:9457"], "is not one of --peers"),
    (["--block-ranks", "0"], "block_ranks=0 must be >= 1"),
])
def test_peers_this_collector_cannot_place_itself_in_are_refused_saying_what_to_give(argv, message):
    with pytest.raises(ValueError, match=message):
        _parsed(*argv)
