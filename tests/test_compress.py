"""The codec alone (no Ray, no sockets): byte planes against numpy's bit arithmetic, frames
round-trip bit-exactly, corrupt or truncated frames fail before the destination is written,
and the policy's choices from given measurements."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hetccl_ray.tools.benchdata import gradients, random_bits, rank_data
from hetccl_ray.transport.compress import frames
from hetccl_ray.transport.compress.frames import FRAME_BYTES, CodecStats, Decoder, Encoder, FrameError, FrameReader
from hetccl_ray.transport.compress.planes import array, entropy_bytes, layout_for
from hetccl_ray.transport.compress.policy import REPROBE, LinkPolicy

FLOATS = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def _every_pattern(dtype: torch.dtype) -> torch.Tensor:
    """Every 16-bit pattern (NaNs, infinities, subnormals, -0), or random bits and the specials."""
    if dtype in (torch.bfloat16, torch.float16):
        return torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype)
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, -1e-310], dtype=dtype)
    bits = torch.randint(0, 256, (4096 * specials.element_size(),), dtype=torch.uint8).view(dtype)
    return torch.cat([specials, bits])


def _planes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The planes of ``x``."""
    coded = torch.empty(x.numel(), dtype=torch.uint8)
    rest = torch.empty(x.numel() * (x.element_size() - 1), dtype=torch.uint8)
    layout_for(x.dtype).split(array(x.view(torch.uint8)), array(coded), array(rest))
    return coded, rest


@pytest.mark.parametrize("dtype", FLOATS)
def test_planes_join_back_to_every_bit_pattern(dtype):
    x = _every_pattern(dtype)
    coded, rest = _planes(x)
    out = torch.empty(x.numel() * x.element_size(), dtype=torch.uint8)
    layout_for(dtype).join(array(coded), array(rest), array(out))
    np.testing.assert_array_equal(out.numpy(), x.view(torch.uint8).numpy())


def test_entropy_bytes_of_a_constant_plane_is_none_and_of_uniform_bytes_all():
    assert entropy_bytes(np.full(4096, 7, dtype=np.uint8)) == 0
    assert entropy_bytes(np.tile(np.arange(256, dtype=np.uint8), 16)) == pytest.approx(4096)


@pytest.mark.parametrize("dtype", FLOATS)
def test_the_coded_plane_is_the_top_byte_and_the_rest_the_low_bytes_planar(dtype):
    x = _every_pattern(dtype)
    w, n = x.element_size(), x.numel()
    u = x.view(torch.uint8).numpy().view(_UINT[w]).astype(np.uint64)
    coded, rest = _planes(x)
    np.testing.assert_array_equal(coded.numpy(), u >> np.uint64(8 * (w - 1)))
    planes, at, offset, low = rest.numpy(), 0, 0, np.zeros(n, np.uint64)
    for width in {2: [1], 4: [2, 1], 8: [4, 2, 1]}[w]:  # widest piece first
        piece = planes[at:at + n * width].view({1: np.uint8, 2: np.uint16, 4: np.uint32}[width])
        low |= piece.astype(np.uint64) << np.uint64(offset)
        at, offset = at + n * width, offset + 8 * width
    np.testing.assert_array_equal(low, u & np.uint64((1 << (8 * (w - 1))) - 1))


def _encode(x: torch.Tensor, encoder: Encoder = None) -> bytes:
    return b"".join(bytes(view) for view in (encoder or Encoder()).frames(x, layout_for(x.dtype), CodecStats()))


def _decode(stream: bytes, like: torch.Tensor, out: torch.Tensor = None) -> torch.Tensor:
    """Feed ``stream`` to a FrameReader the way the socket does: each buffer it asks for, in turn."""
    out = torch.zeros_like(like) if out is None else out
    whole = out.view(torch.uint8)
    reader = FrameReader(layout_for(like.dtype), whole.numel(), Decoder(),
                         lambda offset, n: whole[offset:offset + n], lambda offset, n: None)
    at = 0
    while (view := reader.want()) is not None:
        if at + len(view) > len(stream):
            raise EOFError("stream ended inside a frame")
        view[:] = stream[at:at + len(view)]
        at += len(view)
        reader.filled()
    assert at == len(stream) and reader.stats.wire == len(stream) and reader.stats.raw == whole.numel()
    return out


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("count", [1, 1000, FRAME_BYTES // 2 + 3, 3 * FRAME_BYTES // 2 + 1])
def test_frames_round_trip_bit_exactly(dtype, count):
    x = _every_pattern(dtype).repeat(count // 4096 + 1)[:count]
    stream = _encode(x)
    np.testing.assert_array_equal(_decode(stream, x).view(torch.uint8).numpy(), x.view(torch.uint8).numpy())


def test_gradients_shrink_and_random_bits_go_stored():
    n = 1 << 20
    enc = Encoder()
    for dtype, most in [(torch.bfloat16, 0.75), (torch.float32, 0.88), (torch.float16, 0.75)]:
        grads = gradients(n, dtype)
        stream = _encode(grads, enc)
        assert len(stream) <= most * grads.numel() * grads.element_size(), (dtype, len(stream))
        assert torch.equal(_decode(stream, grads).view(torch.uint8), grads.view(torch.uint8))
    noise = random_bits(n, torch.bfloat16)
    stream = _encode(noise)
    assert len(stream) > 0.99 * n * 2  # stored: nothing to gain
    assert torch.equal(_decode(stream, noise).view(torch.uint8), noise.view(torch.uint8))


def test_rank_data_is_each_ranks_rotation_of_the_same_gradients():
    a, b = rank_data("grads", 0, 10000, torch.float32), rank_data("grads", 1, 10000, torch.float32)
    assert not torch.equal(a, b) and torch.equal(torch.roll(a, 7919), b)
    assert torch.equal(rank_data("fill", 2, 5, torch.float32), torch.full((5,), 3.0))


def _corrupt(stream: bytes, at: int) -> bytes:
    return stream[:at] + bytes([stream[at] ^ 0x5A]) + stream[at + 1:]


@pytest.mark.parametrize("where,message", [
    ("rest", "checksum"), ("coded", "does not decode|checksum"), ("crc", "checksum"),
    ("size", "frame of"), ("codec", "unknown codec"), ("length", "coded plane of"),
])
def test_a_corrupt_frame_is_an_error_and_writes_nothing(where, message):
    x = gradients(FRAME_BYTES // 4, torch.float32)  # one frame
    stream = _encode(x)
    rest_bytes = x.numel() * 3
    at = {"codec": 0, "size": 2, "crc": 6, "rest": 9 + 100, "length": 9 + rest_bytes + 1,
          "coded": 9 + rest_bytes + 4 + 20}[where]
    out = torch.full_like(x, 7.0)
    with pytest.raises((FrameError, EOFError), match=f"corrupt frame 0 .*({message})|stream ended"):
        _decode(_corrupt(stream, at), x, out)
    assert torch.equal(out, torch.full_like(x, 7.0))


def test_a_truncated_payload_cannot_complete():
    x = gradients(1000, torch.bfloat16)
    with pytest.raises(EOFError):
        _decode(_encode(x)[:-1], x)


def test_frames_are_whole_elements_of_at_most_frame_bytes():
    x = gradients(FRAME_BYTES, torch.float32)  # 4 frames
    stream = _encode(x)
    heads = []
    at = 0
    while at < len(stream):
        codec, raw, _ = frames._HEAD.unpack_from(stream, at)
        heads.append(raw)
        at += frames._HEAD.size + raw // 4 * 3
        (coded,) = frames._CODED.unpack_from(stream, at)
        at += frames._CODED.size + coded
    assert heads == [FRAME_BYTES] * 4


# -- the policy -------------------------------------------------------------------------------

def _measured(link_MBps: float, ratio: float, codec_MBps: float, mode: str = "auto") -> LinkPolicy:
    policy = LinkPolicy(mode)
    assert policy.choose()  # the first eligible message measures the codec
    policy.note_encode(1 << 20, int(ratio * (1 << 20)), (1 << 20) / (codec_MBps * 1e6))
    policy.note_decode(1 << 20, (1 << 20) / (2 * codec_MBps * 1e6))
    policy.note_link(link_MBps * 1e6, app_limited=False)
    return policy


def test_auto_compresses_a_slow_link_with_a_fast_codec_and_good_ratio():
    assert _measured(62, 0.68, 400).choose()


@pytest.mark.parametrize("link,ratio,codec", [(3000, 0.68, 400), (62, 1.0, 400), (62, 0.5, 40), (62, 0.95, 400)])
def test_auto_stays_raw_where_compression_would_not_save_time(link, ratio, codec):
    policy = _measured(link, ratio, codec)
    choices = [policy.choose() for _ in range(3 * REPROBE)]
    assert sum(choices) == 3  # only the periodic probes
    assert not policy.describe()["compressing"]


def test_samples_the_sender_limited_count_only_while_there_is_no_other():
    policy = _measured(62, 0.68, 400)
    for burst in (10e6, 5e9):  # sender-limited: ignored once there is a real sample
        policy.note_link(burst, app_limited=True)
    assert policy.link_Bps == pytest.approx(62e6) and policy.choose()
    for rate in (60e6, 2e9, 64e6, 3e9, 61e6):  # bursts through a token bucket read at line rate
        policy.note_link(rate, app_limited=False)
    assert policy.link_Bps == pytest.approx(62e6, rel=0.05) and policy.choose()  # the median holds
    fresh = LinkPolicy()
    fresh.note_link(5e9, app_limited=True)
    assert fresh.link_Bps == 5e9
    fresh.note_link(3e9, app_limited=False)  # the first real sample replaces it
    assert fresh.link_Bps == 3e9


def test_on_and_off_do_not_measure_their_way_out():
    on = _measured(3000, 1.0, 10, mode="on")
    assert all(on.choose() for _ in range(10))
    off = LinkPolicy("off")
    assert not off.eligible(1 << 20, torch.float32)
    assert not LinkPolicy().eligible(1 << 20, torch.int64) and not LinkPolicy().eligible(1000, torch.float32)
    assert LinkPolicy("on").eligible(2, torch.bfloat16) and not LinkPolicy("on").eligible(8, torch.int64)
    with pytest.raises(ValueError, match="compress must be one of"):
        LinkPolicy("sometimes")
