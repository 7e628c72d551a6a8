"""Rendezvous ports for torch.distributed groups.

A module of its own, importing neither torch nor the rest of posttrain: `RayWorkerGroup` finds
the port with a Ray task on the rank-0 node, and the worker that runs it imports this module
alone (from `worker_group`, the task imported torch first: ~3.5 s of CPU on the path of every
run's start, measured).
"""

from __future__ import annotations

import random
import socket


# Where rendezvous ports are drawn from: above Ray's worker ports (10002-19999 by default) and
# below the kernel's ephemeral range (Linux: 32768 up). A port the kernel handed out as free
# (bind to port 0) lies inside the ephemeral range, where it can become the local end of any
# outgoing connection before the rendezvous binds it (Ray opens many while workers start):
# a test run failed with EADDRINUSE that way.
RENDEZVOUS_PORTS = (20000, 32768)


def free_port(host: str = "") -> int:
    """A TCP port on `host` that no one listens on now, outside the ephemeral port range
    (`RENDEZVOUS_PORTS`), so only a new listener, not an outgoing connection, can take it
    before the torch.distributed store binds it."""
    lo, hi = RENDEZVOUS_PORTS
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            hi = min(hi, int(f.read().split()[0]))
    except (OSError, ValueError, IndexError):
        pass
    rng = random.Random()  # not the global stream: seeding a run must not make runs collide
    for _ in range(100):
        port = rng.randrange(lo, hi)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # the whole range taken: any free port
        s.bind((host, 0))
        return s.getsockname()[1]


def node_ip_and_free_port() -> tuple[str, int]:
    """This node's IP address and a free port on it: run as a Ray task on the rank-0 bundle's node."""
    import ray

    return ray.util.get_node_ip_address(), free_port()
