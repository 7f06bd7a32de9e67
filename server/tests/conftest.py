"""Fixtures for collector tests: protocol batches and a collector app on a fresh database."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest

# Starlette's TestClient warns that it will move to httpx2; nothing to act on here.
warnings.filterwarnings("ignore", message="Using `httpx` with `starlette.testclient`")
from fastapi.testclient import TestClient  # noqa: E402

from ampwatch.server import ServerConfig, create_app  # noqa: E402
from ampwatch_support.webhook_receiver import WebhookReceiver  # noqa: E402


@pytest.fixture
def config_for(tmp_path) -> Callable[..., ServerConfig]:
    def build(**overrides: Any) -> ServerConfig:
        # Starlette's TestClient sends "Host: testserver", a name the collector serves only when told.
        return ServerConfig(db=str(tmp_path / "ampwatch.db"), **{"allowed_hosts": ("testserver",), **overrides})
    return build


@pytest.fixture
def client(config_for) -> Iterator[TestClient]:
    """A collector app on a fresh database, lifespan running."""
    with TestClient(create_app(config_for())) as c:
        yield c


@pytest.fixture
def receiver() -> Iterator[WebhookReceiver]:
    """A real HTTP receiver on loopback that records each request (notification tests)."""
    with WebhookReceiver() as r:
        yield r
