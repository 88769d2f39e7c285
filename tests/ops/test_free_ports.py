"""The ports a restartable server is given: outside the range the kernel hands to outgoing
connections, so none of those can take a stopped server's port before it starts again."""

from __future__ import annotations

import socket
from pathlib import Path

from k8s_dispatch.ops.processes import SERVER_PORTS_FLOOR, free_port, free_ports


def _ephemeral() -> range:
    low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    return range(low, high + 1)


def test_ports_are_distinct_bindable_and_outside_the_ephemeral_range():
    ports = [*free_ports(10), free_port()]
    assert len(set(ports[:10])) == 10
    for port in ports:
        assert port >= SERVER_PORTS_FLOOR and port not in _ephemeral()
        with socket.create_server(("127.0.0.1", port)):
            pass


def test_outgoing_connections_take_their_ports_from_the_ephemeral_range():
    """The premise: what a connection is given is never a port `free_ports` hands out."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        clients = [socket.create_connection(server.getsockname()) for _ in range(50)]
        try:
            taken = {c.getsockname()[1] for c in clients}
        finally:
            for c in clients:
                c.close()
    assert len(taken) == 50 and taken <= set(_ephemeral())


def test_a_port_in_use_is_never_handed_out():
    with socket.create_server(("127.0.0.1", free_port())) as busy:
        port = busy.getsockname()[1]
        assert all(port not in free_ports(50) for _ in range(20))
