"""A rendezvous port is drawn where no outgoing connection or ``bind(0)`` can take it before the
rendezvous binds it (the suite's EADDRINUSE under load)."""

from __future__ import annotations

import socket

import pytest

from syncpoint.workers.supervision import free_ports


def test_ports_are_below_the_ephemeral_range_distinct_and_bindable():
    low = free_ports.ephemeral_low()
    ports = free_ports.free_ports(8)
    assert len(set(ports)) == 8 and all(20000 <= p < low for p in ports)  # above `ray start`'s worker ports
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_handed_out_is_not_handed_out_again_and_a_bound_one_is_skipped():
    before = set(free_ports._HANDED_OUT)
    taken = socket.socket()
    taken.bind(("127.0.0.1", free_ports.free_port()))
    taken.listen()
    try:
        drawn = [free_ports.free_port() for _ in range(50)]
        assert len(set(drawn)) == 50 and not set(drawn) & before
        assert taken.getsockname()[1] not in drawn
    finally:
        taken.close()


def test_an_unreadable_range_falls_back_to_linuxs_default(monkeypatch, tmp_path):
    monkeypatch.setattr(free_ports, "_RANGE_FILE", str(tmp_path / "missing"))
    assert free_ports.ephemeral_low() == 32768
    (tmp_path / "garbage").write_text("x")
    monkeypatch.setattr(free_ports, "_RANGE_FILE", str(tmp_path / "garbage"))
    assert free_ports.ephemeral_low() == 32768


def test_a_seeded_random_module_does_not_repeat_the_draw():
    """A training loop seeds ``random`` (exact resume); two processes that trained with one seed must not
    draw the same ports."""
    import random

    random.seed(1234)
    first = free_ports.free_ports(4)
    for p in first:
        free_ports._HANDED_OUT.discard(p)  # as a second process, which never handed them out
    random.seed(1234)
    assert set(free_ports.free_ports(4)) != set(first)


def test_a_narrowed_ephemeral_range_is_drawn_below_and_running_out_is_said(monkeypatch, tmp_path):
    """An ephemeral range starting near 20000 moves the draw below it; no port found within the tries is an
    error naming the range, never a port that may be in use."""
    (tmp_path / "range").write_text("22000\t60999\n")
    monkeypatch.setattr(free_ports, "_RANGE_FILE", str(tmp_path / "range"))
    assert all(22000 - 4096 <= p < 22000 for p in free_ports.free_ports(4))
    monkeypatch.setattr(free_ports, "_TRIES", 0)
    with pytest.raises(OSError, match="no 1 free TCP ports on 127.0.0.1 below 22000"):
        free_ports.free_port()
