"""workers.tp_verifier.free_port: a port picked now for a bind seconds later (a server's
gRPC and HTTP ports, the ranks' rendezvous) comes from outside the kernel's ephemeral
range, which outgoing connections draw from (a full `make test` once failed with
"Failed to bind to address" when a server's picked port had been handed to one)."""

from __future__ import annotations

import random
import socket
from contextlib import closing
from types import SimpleNamespace

from workers import tp_verifier
from workers.tp_verifier import PICKED_PORTS_FROM, _ephemeral_start, free_port


def test_picked_ports_are_free_and_below_the_ephemeral_range():
    stop = _ephemeral_start()
    assert stop - PICKED_PORTS_FROM >= 1000  # this machine: 32768 (Linux's default)
    ports = [free_port() for _ in range(20)]
    assert all(PICKED_PORTS_FROM <= port < stop for port in ports), ports
    assert len(set(ports)) >= 15, ports  # drawn at random, not one port each time
    for port in ports:
        with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
            sock.bind(("127.0.0.1", port))  # free indeed


def test_the_programs_own_seed_does_not_choose_the_port():
    """Two processes that seed `random` alike (tests and benchmarks do) must not pick
    the same port."""
    state = random.getstate()
    try:
        picks = []
        for _ in range(3):
            random.seed(1234)
            picks.append(free_port())
    finally:
        random.setstate(state)
    assert len(set(picks)) > 1, picks


def test_a_port_in_use_is_skipped(monkeypatch):
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as probe:
            probe.bind(("127.0.0.1", 0))
            other = probe.getsockname()[1]

        class Scripted:
            draws = iter([busy, other])

            def randrange(self, start, stop):
                return next(self.draws)

        monkeypatch.setattr(tp_verifier, "random", SimpleNamespace(Random=Scripted))
        assert free_port() == other
