"""Which accelerator this rank trains on: the batch's ``device`` (docs/protocol.md), read once at ``watch()``."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from ampwatch.contract.batch import DeviceInfo

from ._errors import AgentErrors
from ._limits import TEXT_LIMITS, cut

__all__ = ["device_info", "trained_device", "watched_device"]

log = logging.getLogger("ampwatch.agent")


def watched_device(records: Iterable[Any], errors: AgentErrors) -> DeviceInfo | None:
    """Return the device of ``records``' optimizers' parameters as the batch's ``device``; None if unreadable."""
    try:
        return device_info(trained_device(r.optimizer for r in records))
    except Exception as error:  # noqa: BLE001 - the watch goes on without naming its device
        errors.report("reading the device", error)
        return None


def trained_device(optimizers: Iterable[torch.optim.Optimizer]) -> torch.device | None:
    """Return the device of the first optimizer's first parameter (the watched parameters'), or None: no sync."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for param in group["params"]:
                return param.device
    return None


def device_info(device: torch.device | None) -> DeviceInfo | None:
    """Return ``device`` as the protocol names it: its type; on a GPU its index, UUID and PCI bus id where torch
    reads them (``torch.cuda.get_device_properties``: a host query, no sync). None without a device."""
    if device is None:
        return None
    limit = TEXT_LIMITS["device_text"]
    info: DeviceInfo = {"type": cut(device.type, limit)}
    if device.type == "cpu":
        return info
    index = device.index
    if index is None and device.type == "cuda":
        index = torch.cuda.current_device()
    if index is not None:
        info["index"] = int(index)
    if device.type == "cuda" and index is not None:
        try:
            properties = torch.cuda.get_device_properties(index)
        except Exception as error:  # noqa: BLE001 - the rank is still reported, by type and index
            log.debug("ampwatch: cannot read the properties of %s: %s", device, error)
            return info
        uuid = _uuid(properties)
        if uuid:
            info["uuid"] = cut(uuid, limit)
        bus = _pci_bus_id(properties)
        if bus:
            info["pci_bus_id"] = cut(bus, limit)
    return info


def _uuid(properties: Any) -> str | None:
    """Return a GPU's UUID as ``nvidia-smi -L`` writes it (``GPU-<hex>``), or None where torch has none."""
    raw = getattr(properties, "uuid", None)
    if raw is None:
        return None
    text = str(raw)
    if not text or text.strip("0-") == "":
        return None  # an all-zero UUID: the driver gave none
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


def _pci_bus_id(properties: Any) -> str | None:
    """Return ``domain:bus:device.0`` in hex (``0000:3b:00.0``, as sysfs writes it), where torch reads all three."""
    parts = [getattr(properties, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if not all(isinstance(p, int) for p in parts):
        return None
    domain, bus, slot = parts
    return f"{domain:04x}:{bus:02x}:{slot:02x}.0"
