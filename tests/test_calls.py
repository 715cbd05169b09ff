"""Call descriptors alone: encoding, and the disagreement message that names odd ranks."""

import pytest
import torch

from hetccl_ray.core.calls import Call, disagreement

CALLS = [Call("allreduce", torch.float32, 1000, reduce="max", seq=7),
         Call("broadcast", torch.uint8, 0, root=3, seq=1),
         Call("reducescatter", torch.bfloat16, 1 << 40, reduce="product", seq=1 << 33),
         Call("barrier", torch.uint8, 0, seq=2)]


@pytest.mark.parametrize("call", CALLS, ids=str)
def test_a_call_survives_encoding(call):
    assert Call.decode(call.encode()) == call


def test_agreeing_ranks_have_no_disagreement():
    assert disagreement([CALLS[0]] * 5) is None


def test_disagreement_names_the_odd_ranks_and_what_they_called():
    a, b = CALLS[0], Call("allreduce", torch.float64, 1000, reduce="max", seq=7)
    text = disagreement([a, a, b, a])
    assert text == ("ranks [0, 1, 3] called allreduce #7(float32, 1000 elements, max); "
                    "ranks [2] called allreduce #7(float64, 1000 elements, max)")
