"""find_free_port: ports the kernel cannot hand to an outgoing connection, free together, and never one in use."""

import socket

import pytest

from slime.utils import misc


def _listen(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


@pytest.mark.parametrize("count", [1, 8])
def test_ports_are_free_together_and_below_the_ephemeral_range(count):
    base = misc.find_free_port(count=count)
    ephemeral = misc._ephemeral_port_range()
    if ephemeral is not None and ephemeral[0] > 12000:
        assert base + count - 1 < ephemeral[0]
    listeners = [_listen(port) for port in range(base, base + count)]  # raises if any of them was taken
    for sock in listeners:
        sock.close()


def test_a_block_with_a_port_in_use_is_skipped(monkeypatch):
    held_base = misc.find_free_port(count=4)
    held = _listen(held_base + 2)
    other = misc.find_free_port(count=4)
    picks = iter([held_base, other])

    class Scripted:
        def randrange(self, low, high):
            return next(picks)

    monkeypatch.setattr(misc.random, "SystemRandom", Scripted)
    try:
        assert misc.find_free_port(count=4) == other  # the block around the held port was refused
    finally:
        held.close()


def test_without_a_readable_range_any_free_port_serves(monkeypatch):
    monkeypatch.setattr(misc, "_ephemeral_port_range", lambda: None)
    _listen(misc.find_free_port()).close()
