"""The TCP border alone, two ranks in this process over real loopback sockets: strangers are
refused and logged, the secret appears in no log record or repr, the real peers still talk."""

from __future__ import annotations

import logging
import socket

import numpy as np
import pytest
import torch

from hetccl_ray.transport.base import Tag
from hetccl_ray.transport.tcp import TcpBorder

SECRET = bytes(range(32))


@pytest.fixture
def pair():
    borders = [TcpBorder(r, "127.0.0.1") for r in range(2)]
    addresses = {r: b.address for r, b in enumerate(borders)}
    for r, border in enumerate(borders):
        border.set_peers({p: a for p, a in addresses.items() if p != r}, SECRET)
    yield borders
    for border in borders:
        border.close()


def test_stranger_is_refused_logged_and_the_secret_never_shown(pair, caplog):
    caplog.set_level(logging.DEBUG)
    with socket.create_connection(pair[1].address, timeout=5) as stranger:
        challenge = stranger.recv(16)
        stranger.sendall(b"\x00\x00\x00\x00" + bytes(32))    # claims rank 0, wrong proof
        stranger.settimeout(5)
        assert stranger.recv(2) == b""                        # dropped
    data, out = torch.arange(1000, dtype=torch.float64), torch.zeros(1000, dtype=torch.float64)
    handles = [pair[0].isend(1, data, Tag(1, 1, 6)), pair[1].irecv(0, out, Tag(1, 1, 6))]  # rank 0 dials
    for handle in handles:
        handle.wait(10)
    np.testing.assert_array_equal(out.numpy(), data.numpy())
    assert pair[1].rejected == 1 and len(challenge) == 16
    refused = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
    assert len(refused) == 1 and "bad credentials (claimed rank 0)" in refused[0], refused
    shown = " ".join([r.getMessage() for r in caplog.records] + [repr(b) for b in pair])
    assert SECRET.hex() not in shown and str(SECRET) not in shown


def test_listener_binds_to_the_address_asked_for(pair):
    assert {b.address[0] for b in pair} == {"127.0.0.1"}
