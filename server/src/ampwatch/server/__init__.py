"""The ampwatch collector: ingest agent batches, keep them in SQLite, expose them to Prometheus."""

from ._app import VERSION, create_app
from ._config import ServerConfig

__all__ = ["create_app", "ServerConfig", "VERSION"]
