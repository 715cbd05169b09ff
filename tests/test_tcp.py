"""The TCP border alone, two ranks in this process over real loopback sockets: strangers are
refused and logged, the secret appears in no log record or repr, the real peers still talk."""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
import torch

from hetccl_ray.tools.benchdata import gradients
from hetccl_ray.transport.compress.frames import FRAME_BYTES, Encoder
from hetccl_ray.errors import HetCCLMismatchError, HetCCLPeerError
from hetccl_ray.transport.base import Tag
from hetccl_ray.transport.tcp import TcpBorder, dial

SECRET = bytes(range(32))


@pytest.fixture(params=["tcp", "unix"])
def pair(request):
    """Two borders on this host: over TCP, or (``same_host``) over an abstract Unix socket;
    "-on" after the kind: compress every float payload."""
    kind, _, compress = request.param.partition("-")
    borders = [TcpBorder(r, "127.0.0.1", compress or "auto", same_host=kind == "unix") for r in range(2)]
    addresses = {r: b.address for r, b in enumerate(borders)}
    for r, border in enumerate(borders):
        border.set_peers({p: a for p, a in addresses.items() if p != r}, SECRET)
    yield borders
    for border in borders:
        border.close()


def test_stranger_is_refused_logged_and_the_secret_never_shown(pair, caplog):
    caplog.set_level(logging.DEBUG)
    with dial(pair[1].address, timeout_s=5) as stranger:  # by Unix socket where it listens on one
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


def _both(first, second, timeout=20):
    """Wait on one rank's handles in a thread and the other's here: each border is driven by
    whoever waits on it, so a payload larger than the socket buffers needs both sides waiting."""
    errors = []

    def wait_all(handles):
        try:
            for handle in handles:
                handle.wait(timeout)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    thread = threading.Thread(target=wait_all, args=(second,))
    thread.start()
    wait_all(first)
    thread.join()
    if errors:
        raise errors[0]


@pytest.mark.parametrize("pair", ["tcp-on", "unix-on"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.float64])
def test_compressed_payloads_land_and_reduce_bit_exactly(pair, dtype):
    n = 3 * FRAME_BYTES // 2 + 5  # several frames, the last one short
    x = gradients(n, dtype)
    out, acc = torch.zeros(n, dtype=dtype), torch.ones(n, dtype=dtype)
    _both([pair[0].isend(1, x, Tag(1, 1, 0)), pair[0].isend(1, x, Tag(1, 2, 0))],
          [pair[1].irecv(0, out, Tag(1, 1, 0)), pair[1].irecv(0, acc, Tag(1, 2, 0), op="sum")])
    np.testing.assert_array_equal(out.view(torch.uint8).numpy(), x.view(torch.uint8).numpy())
    np.testing.assert_array_equal(acc.to(torch.float64).numpy(), (torch.ones(n, dtype=dtype) + x).to(torch.float64))
    assert pair[0].bytes_sent == 2 * n * x.element_size() == pair[1].bytes_received
    assert pair[0].wire_bytes_sent == pair[1].wire_bytes_received < 0.95 * pair[0].bytes_sent
    assert pair[0].compression()[1]["messages_compressed"] == 2


@pytest.mark.parametrize("pair", ["tcp-on", "unix-on"], indirect=True)
def test_a_corrupt_frame_is_an_error_naming_the_peer(pair, monkeypatch):
    frames = Encoder.frames

    def corrupting(self, buf, layout, stats):
        """FAKE corruption (TCP does not corrupt): frame 0's coded plane has one bit flipped
        after its checksum was taken."""
        for k, view in enumerate(frames(self, buf, layout, stats)):
            yield memoryview(bytes(view[:-1]) + bytes([view[-1] ^ 1])) if k == 3 else view
    monkeypatch.setattr(Encoder, "frames", corrupting)
    x = gradients(FRAME_BYTES // 4, torch.float32)
    out = torch.full_like(x, 7.0)
    send = pair[0].isend(1, x, Tag(1, 1, 0))  # rank 0 dials
    with pytest.raises(HetCCLPeerError, match=r"rank 1 <-> rank 0 failed: corrupt frame 0 .*(checksum|decode)"):
        _both([pair[1].irecv(0, out, Tag(1, 1, 0))], [send])
    assert torch.equal(out, torch.full_like(x, 7.0))
    with pytest.raises(HetCCLPeerError, match="rank 0 <-> rank 1 failed: connection closed"):
        pair[0].irecv(1, out, Tag(1, 2, 0)).wait(5)  # the sender hears at once, not at its deadline


def test_a_receive_with_free_bits_takes_the_next_message_of_its_family_and_says_which(pair):
    """``free_bits``: the sequence number may differ in those bits only (the bridge's receive
    of whichever call a peer backpropagated first); the tag the message carried is returned."""
    family, other = 0x5 << 40, 0x6 << 40
    x, out = torch.arange(4.0), torch.zeros(4)
    sent = pair[0].isend(1, x, Tag(64, family | 0x2A, 0))  # rank 0 dials
    received = pair[1].irecv(0, out, Tag(64, family, 0), free_bits=(1 << 40) - 1)
    _both([received], [sent])
    np.testing.assert_array_equal(out.numpy(), x.numpy())
    assert received.tag == Tag(64, family | 0x2A, 0)
    sent = pair[0].isend(1, x, Tag(64, other | 0x2A, 0))  # another family: a mismatch, named
    received = pair[1].irecv(0, out, Tag(64, family, 0), free_bits=(1 << 40) - 1)
    with pytest.raises(HetCCLMismatchError, match="expected Tag.*got Tag"):
        _both([received], [sent])


def _flood(address, count: int, held: list) -> None:
    """FAKE attackers (real sockets): ``count`` connections that send nothing, random bytes or
    a wrong proof; idle ones are held open (in ``held``) until the test ends."""
    import os

    for k in range(count):
        try:
            sock = dial(address, timeout_s=1)
        except OSError:
            continue
        kind = k % 3
        try:
            if kind == 1:
                sock.sendall(os.urandom(36))
            elif kind == 2:
                sock.sendall(b"\x00\x00\x00\x00" + bytes(32))  # claims rank 0, wrong proof
        except OSError:  # the border refused this stranger before its bytes went out
            pass
        held.append(sock)


def test_a_flood_of_strangers_costs_no_threads_and_real_peers_still_connect():
    borders = [TcpBorder(r, "127.0.0.1") for r in range(3)]
    addresses = {r: b.address for r, b in enumerate(borders)}
    for r, border in enumerate(borders):
        border.set_peers({p: a for p, a in addresses.items() if p != r}, SECRET)
    held: list = []
    try:
        threads_before = threading.active_count()
        flooders = [threading.Thread(target=_flood, args=(borders[2].address, 700, held), daemon=True)
                    for _ in range(3)]
        for flooder in flooders:
            flooder.start()
        most_threads = threads_before
        for q in range(1, 6):  # ranks 0 and 1 dial rank 2 in the middle of the flood (first use)
            data = torch.arange(256, dtype=torch.float32) + q
            outs = [torch.zeros(256) for _ in range(2)]
            _both([borders[0].isend(2, data, Tag(1, q, 2)), borders[1].isend(2, data, Tag(1, q, 2))],
                  [borders[2].irecv(0, outs[0], Tag(1, q, 2)), borders[2].irecv(1, outs[1], Tag(1, q, 2))])
            for out in outs:
                np.testing.assert_array_equal(out.numpy(), data.numpy())
            most_threads = max(most_threads, threading.active_count())
        for flooder in flooders:
            flooder.join(timeout=60)
            assert not flooder.is_alive(), "the listener stopped accepting during the flood"
        assert borders[2]._acceptor.is_alive()
        most_threads = max(most_threads, threading.active_count())
        assert most_threads <= threads_before + 3 + 1  # the flooders and _both's waiter, nothing per connection
        assert borders[2].rejected >= 2 * 2100 // 3 - 64  # garbage and wrong proofs refused; idle ones time out
    finally:
        for sock in held:
            sock.close()
        for border in borders:
            border.close()
