"""Dump YAML that people can read and diff: block literals for multi-line strings."""

from __future__ import annotations

from typing import Any

import yaml

__all__ = ["dump_yaml"]


class _ReadableDumper(yaml.SafeDumper):
    pass


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_ReadableDumper.add_representer(str, _represent_str)


def dump_yaml(document: Any) -> str:
    """Dump a document as block-style YAML, keys in insertion order."""
    return yaml.dump(document, Dumper=_ReadableDumper, sort_keys=False,
                     default_flow_style=False, allow_unicode=True, width=100)
