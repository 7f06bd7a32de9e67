"""support's free_port: a port found free now, below the range the kernel hands to outgoing connections.

A DDP job's launcher finds a port and its ranks bind it seconds later: from the ephemeral range, any outgoing
connection meanwhile could take it (a rendezvous store failed with EADDRINUSE in CI).
"""

from __future__ import annotations

import socket

from ampwatch_support.ports import free_port


def test_free_ports_lie_below_the_ephemeral_range_and_can_be_bound():
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    ports = [free_port() for _ in range(50)]
    assert all(1024 <= port < low for port in ports), ports
    assert len(set(ports)) > 40  # drawn at random, not one fixed port
    for port in ports[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
