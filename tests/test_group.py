"""The hetccl backend through ray.util.collective on a real local multi-node Ray cluster.

Nodes carry ``hetccl.io/island`` labels; actors are placed with label selectors. Every op,
dtype and size is checked against numpy, and border byte counters against the lower bound.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import ray
import torch
from ray.util import collective as col

import hetccl_ray
from hetccl_ray.tools import bench
from hetccl_ray.runtime import small_round
from tests import cluster as test_cluster
from tests.cases import DTYPES, REDUCE_OPS, SIZES, as_float, itemsize, libs, make, seed_of, values

# group name -> (actor picks as (island, index) in rank order)
LAYOUTS = {
    "two": [("a", 0), ("a", 1), ("b", 0), ("b", 1)],                          # 2 islands, 2+2
    "three": [("a", 0), ("b", 0), ("a", 1), ("c", 0), ("b", 1), ("a", 2)],    # 1+2+3 interleaved
    "one": [("a", 0), ("a", 1), ("a", 2)],                                    # one island
}
LAYOUTS.update({f"{name}-zip": LAYOUTS[name] for name in ("two", "three")})  # compress="on": every float
# flat="on": the flat library over every rank, Gloo ("two-flat", same_host=False) or shared memory
LAYOUTS.update({f"{name}-flat": LAYOUTS[name] for name in ("two", "three")})
LAYOUTS["two-tcp"] = LAYOUTS["two"]  # same_host=False: loopback TCP where "two" dials Unix sockets
SAME_HOST_OFF = ("two-tcp", "two-flat")
ISLAND_COUNT = {"two": 2, "three": 3, "one": 1, "two-zip": 2, "three-zip": 3, "two-flat": 2, "three-flat": 3,
                "two-tcp": 2}
SMALL_BYTES = 16384  # buffers up to this take the small-message round, larger ones the island plans


def across(name: str, nbytes: int, bytes_of_plan: int) -> int:
    """Border bytes of a call of ``nbytes`` (nccl-tests' size) whose hierarchical plan moves
    ``bytes_of_plan``: a flat Gloo group moves what the small round does not through Gloo,
    a shared-memory one moves every CPU call there (no round)."""
    flat = name.endswith("-flat") and (name not in SAME_HOST_OFF or nbytes > SMALL_BYTES)
    return 0 if flat else bytes_of_plan


@pytest.fixture(scope="module")
def actors():
    cluster, actors = test_cluster.start({"a": 3, "b": 2, "c": 1})
    for name, picks in LAYOUTS.items():
        members = [actors[island][i] for island, i in picks]
        zipped = dict(compress="on", piece_bytes=4096 if name == "three-zip" else 4 << 20) if "zip" in name else {}
        zipped.update(flat="on" if name.endswith("-flat") else "off", same_host=name not in SAME_HOST_OFF)
        hetccl_ray.create_collective_group(members, len(members), list(range(len(members))),
                                           group_name=name, timeout_s=60, small_bytes=SMALL_BYTES, **zipped)
    picks = [actors[island][i] for island, i in LAYOUTS["three"]]  # the same ranks, pipelined in small pieces
    hetccl_ray.create_collective_group(picks, len(picks), list(range(len(picks))), group_name="pieces",
                                       timeout_s=60, small_bytes=SMALL_BYTES, piece_bytes=4096, flat="off")
    hetccl_ray.create_collective_group(picks, len(picks), list(range(len(picks))), group_name="one-hop",
                                       timeout_s=60, small_bytes=SMALL_BYTES, flat="off", one_hop=True)
    yield actors
    test_cluster.stop(cluster)


def members(actors, name):
    return [actors[island][i] for island, i in LAYOUTS["three" if name in ("pieces", "one-hop") else name]]


def on_all(actors, name, fn, *args):
    group = members(actors, name)
    return ray.get([a.call.remote(fn, name, rank, len(group), *args) for rank, a in enumerate(group)], timeout=600)


# -- functions that run inside the actors ------------------------------------------------------

def _last_bytes(name):
    return hetccl_ray.border_stats(name)["last_op_bytes_sent"]


def sweep_allreduce(name, rank, world):
    out = {}
    for dtype in DTYPES:
        for n in SIZES:
            for op in REDUCE_OPS:
                for lib in libs(dtype):
                    high = 3 if op == "PRODUCT" else 4
                    x = make(values(rank, n, seed_of(dtype, n, op), low=1, high=high), dtype, lib)
                    col.allreduce(x, group_name=name, op=getattr(col.types.ReduceOp, op))
                    out[dtype, n, op, lib] = (as_float(x), _last_bytes(name))
    return out


def sweep_rooted(name, rank, world):
    out = {}
    for dtype in ["float32", "bfloat16", "int64", "uint8"]:
        for n in [1, 1031]:
            for root in range(world):
                lib = libs(dtype)[-1]
                x = make(values(rank, n, root), dtype, lib)
                col.broadcast(x, src_rank=root, group_name=name)
                out["broadcast", dtype, n, root] = (as_float(x), _last_bytes(name))
                y = make(values(rank, n, root + 50), dtype, lib)
                col.reduce(y, dst_rank=root, group_name=name, op=col.types.ReduceOp.MAX)
                out["reduce", dtype, n, root] = (as_float(y), _last_bytes(name))
    return out


def sweep_gather_scatter(name, rank, world):
    out = {}
    for dtype in DTYPES:
        for n in [1, 7, 1031]:
            lib = libs(dtype)[rank % len(libs(dtype))]
            x = make(values(rank, n, 7), dtype, lib)
            outs = [make(np.zeros(n), dtype, lib) for _ in range(world)]
            col.allgather(outs, x, group_name=name)
            out["allgather", dtype, n] = (np.stack([as_float(t) for t in outs]), _last_bytes(name))
            ins = [make(values(rank * world + j, n, 8), dtype, lib) for j in range(world)]
            y = make(np.zeros(n), dtype, lib)
            col.reducescatter(y, ins, group_name=name)
            out["reducescatter", dtype, n] = (as_float(y), _last_bytes(name))
    return out


def sweep_sendrecv(name, rank, world):
    got = {}
    for src in range(world):
        for dst in range(world):
            if src == dst:
                continue
            if rank == src:
                col.send(torch.full((5,), src * 100.0 + dst), dst, group_name=name)
            elif rank == dst:
                buf = torch.zeros(5)
                col.recv(buf, src, group_name=name)
                got[src] = buf.numpy().copy()
    return got


def block_sizes(world: int, kind: str) -> np.ndarray:
    """Elements rank r sends rank t: even, uneven, uneven with zeros, or large (pipelined)."""
    if kind == "even":
        return np.full((world, world), 5)
    sizes = np.random.default_rng(world).integers(0 if kind == "zeros" else 1, 40, size=(world, world))
    if kind == "zeros":
        sizes[:, 0] = 0  # nobody sends rank 0 anything
        sizes[1, :] = 0  # rank 1 sends nothing
    return sizes * (700 if kind == "large" else 1)


def block(src: int, dst: int, n: int) -> np.ndarray:
    return values(src, n, 100 + dst)


def sweep_alltoall(name, rank, world, kinds):
    out = {}
    for kind in kinds:
        sizes = block_sizes(world, kind)
        for dtype in DTYPES if kind != "large" else ["float32"]:
            lib = libs(dtype)[rank % len(libs(dtype))]
            ins = [make(block(rank, t, sizes[rank, t]), dtype, lib) for t in range(world)]
            outs = [make(np.full(sizes[r, rank], 99.0), dtype, lib) for r in range(world)]
            hetccl_ray.alltoall(ins, outs, group_name=name)
            out[kind, dtype] = ([as_float(t) for t in outs], _last_bytes(name))
    if "uneven" in kinds:  # blocks as pieces of one buffer each way
        sizes = block_sizes(world, "uneven")
        whole_in = torch.tensor(np.concatenate([block(rank, t, sizes[rank, t]) for t in range(world)]))
        whole_out = torch.full((int(sizes[:, rank].sum()),), 99.0, dtype=torch.float64)
        outs = list(whole_out.split(sizes[:, rank].tolist()))
        hetccl_ray.alltoall(list(whole_in.split(sizes[rank].tolist())), outs, group_name=name)
        out["uneven-split", "float64"] = ([t.numpy() for t in outs], _last_bytes(name))
    group = hetccl_ray.get_group(name)
    x = torch.tensor(block(rank, 0, 9), dtype=torch.float64)
    listed = [torch.zeros(9, dtype=torch.float64) for _ in range(world)] if rank == world - 1 else None
    group.gather(x, listed, world - 1)
    out["gather"] = ([t.numpy() for t in listed] if listed else [], _last_bytes(name))
    y = torch.zeros(9, dtype=torch.float64)
    group.scatter(y, [torch.tensor(block(1, t, 9)) for t in range(world)] if rank == 1 else None, 1)
    out["scatter"] = ([y.numpy()], _last_bytes(name))
    return out


def _wrong_split_then_right(name, rank, world):
    """Rank 0 expects one element more from the last rank than it sends: every rank must
    name the pair; then the same group runs a correct all-to-all."""
    sizes = block_sizes(world, "even")
    outs = [torch.zeros(int(sizes[r, rank]) + (rank == 0 and r == world - 1)) for r in range(world)]
    try:
        hetccl_ray.alltoall([torch.ones(int(n)) for n in sizes[rank]], outs, group_name=name)
        error = None
    except hetccl_ray.HetCCLMismatchError as exc:
        error = str(exc)
    ins = [torch.full((3,), float(rank * 10 + t)) for t in range(world)]
    outs = [torch.zeros(3) for _ in range(world)]
    hetccl_ray.alltoall(ins, outs, group_name=name)
    return error, torch.cat(outs).numpy()


# -- tests -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(LAYOUTS) + ["pieces"])
def test_alltoall_even_uneven_every_dtype(actors, name):
    kinds = ["large"] if name == "pieces" else ["even", "uneven", "zeros"]
    results = on_all(actors, name, sweep_alltoall, kinds)
    world = len(members(actors, name))
    islands = [island for island, _ in LAYOUTS["three" if name == "pieces" else name]]
    for key in results[0]:
        if key in ("gather", "scatter"):
            continue
        kind, dtype = key
        sizes = block_sizes(world, kind.removesuffix("-split"))
        for rank in range(world):
            for src in range(world):
                np.testing.assert_array_equal(results[rank][key][0][src], block(src, rank, sizes[src, rank]),
                                              err_msg=f"{key}: rank {rank} from {src}")
        bound = sum(int(sizes[r, t]) for r in range(world) for t in range(world) if islands[r] != islands[t])
        # flat Gloo groups too (all-to-all goes straight over the border); none in shared memory
        assert sum(results[r][key][1] for r in range(world)) == across(name, 0, bound * itemsize(dtype)), key
    gathered = results[world - 1]["gather"][0]
    for src in range(world):
        np.testing.assert_array_equal(gathered[src], block(src, 0, 9))
        np.testing.assert_array_equal(results[src]["scatter"][0][0], block(1, src, 9))
    to_root = sum(islands[r] != islands[world - 1] for r in range(world))
    assert sum(results[r]["gather"][1] for r in range(world)) == across(name, 0, to_root * 9 * 8)
    from_root = sum(islands[t] != islands[1] for t in range(world))
    assert sum(results[r]["scatter"][1] for r in range(world)) == across(name, 0, from_root * 9 * 8)


def _large_alltoall(name, rank, world):
    """Blocks of 240 KB, more than the shared-memory segments take: then in place (each rank's
    outputs are its inputs)."""
    n = 60_000
    outs = [torch.zeros(n) for _ in range(world)]
    hetccl_ray.alltoall([torch.from_numpy(block(rank, t, n)).float() for t in range(world)], outs, group_name=name)
    sent = _last_bytes(name)
    blocks = list(torch.from_numpy(np.concatenate([block(rank, t, n) for t in range(world)])).float().split(n))
    hetccl_ray.alltoall(blocks, blocks, group_name=name)
    return [o.numpy() for o in outs], [b.numpy() for b in blocks], sent, hetccl_ray.get_group(name).plan_of(
        "alltoall", n * 4 * world)


@pytest.mark.parametrize("name, plan", [("three-flat", "pull"), ("three", "direct")])
def test_large_alltoall_on_one_host_is_pulled_or_goes_straight(actors, name, plan):
    """Where the ranks may read each other's memory, each block is pulled from its sender (no
    border bytes); without shared memory the blocks go straight over sockets."""
    results = on_all(actors, name, _large_alltoall)
    islands = [island for island, _ in LAYOUTS[name]]
    for rank, (outs, in_place, _, taken) in enumerate(results):
        assert taken == plan
        for src in range(6):
            np.testing.assert_array_equal(outs[src], block(src, rank, 60_000).astype(np.float32))
            np.testing.assert_array_equal(in_place[src], block(src, rank, 60_000).astype(np.float32))
    crossing = sum(islands[r] != islands[t] for r in range(6) for t in range(6))
    assert sum(sent for _, _, sent, _ in results) == (0 if plan == "pull" else crossing * 60_000 * 4)


LARGE = (4 << 20) // 4 + 3  # float32 elements: a message from 4 MiB is pulled by its receiver on one host


def _large_ring(name, rank, world):
    """Each rank sends the next a message large enough to be pulled (the bench's ring: even
    ranks send first); the receive sends nothing over the border."""
    got, mine = torch.zeros(LARGE), torch.from_numpy(block(rank, (rank + 1) % world, LARGE)).float()
    before = hetccl_ray.border_stats(name)["bytes_sent"]
    bench.COLLS["sendrecv"].call(name, world, rank, mine, got)()
    sent = hetccl_ray.border_stats(name)["bytes_sent"] - before
    return got.numpy(), sent, hetccl_ray.get_group(name).plan_of("send", LARGE * 4)


@pytest.mark.parametrize("name, plan", [("three-flat", "pull"), ("three", "p2p")])
def test_large_messages_on_one_host_are_pulled_by_their_receivers(actors, name, plan):
    """With shared memory (and ranks that may read each other's memory) only where the bytes
    lie crosses the border (16 B); without, the bytes themselves."""
    results = on_all(actors, name, _large_ring)
    islands = [island for island, _ in LAYOUTS[name]]
    for rank, (got, sent, taken) in enumerate(results):
        left, right = (rank - 1) % 6, (rank + 1) % 6
        assert taken == plan
        np.testing.assert_array_equal(got, block(left, rank, LARGE).astype(np.float32), err_msg=f"rank {rank}")
        assert sent == (islands[rank] != islands[right]) * (16 if plan == "pull" else LARGE * 4), (rank, sent)


def _mismatched_large_message(name, rank, world, received=LARGE):
    started = time.monotonic()
    try:
        if rank == 0:
            col.send(torch.ones(LARGE + 1), 1, group_name=name)
        else:
            col.recv(torch.zeros(received), 0, group_name=name)
    except hetccl_ray.HetCCLError as exc:
        return time.monotonic() - started, str(exc)
    return None, "no error"


def test_a_pulled_message_of_another_size_is_named_and_its_sender_freed(actors):
    """The receiver names both sizes; the sender, waiting for its bytes to be read, fails as
    soon as the receiver's group closes, not at its deadline."""
    pair = [actors["a"][0], actors["b"][0]]
    hetccl_ray.create_collective_group(pair, 2, [0, 1], group_name="pull-mismatch", timeout_s=30, flat="on")
    (sender_s, sender), (_, receiver) = ray.get(
        [a.call.remote(_mismatched_large_message, "pull-mismatch", r, 2) for r, a in enumerate(pair)], timeout=120)
    assert "recv #1 in group 'pull-mismatch'" in receiver, receiver
    assert f"{LARGE * 4} bytes from rank 0" in receiver and f"{LARGE * 4 + 4} bytes" in receiver, receiver
    assert "send #1 in group 'pull-mismatch'" in sender and "rank 1" in sender and sender_s < 10, sender


@pytest.mark.parametrize("received", [4, 256])
def test_a_pulled_message_to_a_small_receive_is_named_not_landed(actors, received):
    """A receive too small to be pulled takes its message straight, so a sender offering a
    larger one to pull is named with its size, even where the offer (16 B) fits the buffer."""
    pair = [actors["a"][0], actors["b"][0]]
    name = f"pull-small-{received}"
    hetccl_ray.create_collective_group(pair, 2, [0, 1], group_name=name, timeout_s=30, flat="on")
    (_, sender), (_, receiver) = ray.get(
        [a.call.remote(_mismatched_large_message, name, r, 2, received) for r, a in enumerate(pair)], timeout=120)
    assert f"recv #1 in group '{name}'" in receiver and "mismatched call" in receiver, receiver
    assert f"{received * 4} bytes from rank 0" in receiver and f"{LARGE * 4 + 4} bytes" in receiver, receiver
    assert "send #1" in sender and "rank 1" in sender, sender


@pytest.mark.parametrize("name", ["two", "three"])
def test_alltoall_mismatched_splits_named_on_every_rank(actors, name):
    results = on_all(actors, name, _wrong_split_then_right)
    world = len(results)
    for rank, (error, after) in enumerate(results):
        assert error is not None and "alltoall #" in error, (rank, error)
        assert f"rank {world - 1} sends 5 elements to rank 0, which expects 6" in error, (rank, error)
        np.testing.assert_array_equal(after, np.array([float(r * 10 + rank) for r in range(world) for _ in range(3)]))


def _alltoall_messages(name, rank, world):
    """Messages this rank sends for an all-to-all of small blocks, then of blocks too large to
    ride in the check's messages, and what it received."""
    out = []
    for n in (8, small_round.RIDE_BYTES // 4 + 1):
        ins = [torch.full((n,), float(rank * 10 + t)) for t in range(world)]
        outs = [torch.zeros(n) for _ in range(world)]
        before = hetccl_ray.border_stats(name)["messages_sent"]
        hetccl_ray.alltoall(ins, outs, group_name=name)
        out.append((hetccl_ray.border_stats(name)["messages_sent"] - before, [o.numpy() for o in outs]))
    ins, outs = [torch.full((8,), float(rank * 10 + t)) for t in range(world)], [torch.zeros(8) for _ in range(world)]
    try:  # rank 0 calls an allreduce (its round carries data) where the others' checks carry blocks
        col.allreduce(torch.ones(8), group_name=name) if rank == 0 else hetccl_ray.alltoall(ins, outs, group_name=name)
        mismatch = None
    except hetccl_ray.HetCCLMismatchError as exc:
        mismatch = str(exc)
    hetccl_ray.alltoall(ins, outs, group_name=name)  # the group goes on, each link at its own messages
    return out, mismatch, [o.numpy() for o in outs]


@pytest.mark.parametrize("name, check, linked", [("two", 6, 6), ("one-hop", 30, 30)])
def test_small_alltoall_blocks_ride_in_the_check(actors, name, check, linked):
    """The check of 2+2 sends 6 messages (members up, leaders across, leaders down), that of a
    one-hop group of 6 ranks 30 (every rank to every rank). A small block to a rank the check
    links this one with rides in its message (2+2: 6 of the 12 blocks; one hop: all 30); a
    larger block follows it: 12 and 30 messages for small blocks, 18 and 60 for large ones."""
    results = on_all(actors, name, _alltoall_messages)
    world = len(results)
    blocks = world * (world - 1)
    for which, expected in ((0, check + blocks - linked), (1, check + blocks)):
        assert sum(counts[which][0] for counts, _, _ in results) == expected, which
        for rank, (counts, _, _) in enumerate(results):
            for src, got in enumerate(counts[which][1]):
                np.testing.assert_array_equal(got, np.full(len(got), src * 10.0 + rank))
    for rank, (_, mismatch, after) in enumerate(results):
        assert mismatch is not None and "allreduce" in mismatch and "alltoall" in mismatch, (rank, mismatch)
        for src, got in enumerate(after):
            np.testing.assert_array_equal(got, np.full(8, src * 10.0 + rank))


def _one_hop_ops(name, rank, world):
    out = {}
    x = torch.tensor(values(rank, 33, 1))
    col.allreduce(x, group_name=name)
    out["allreduce"] = ([x.numpy()], _last_bytes(name))
    for root in (0, world - 1):
        b, r = torch.tensor(values(rank, 33, 2)), torch.tensor(values(rank, 33, 3))
        col.broadcast(b, src_rank=root, group_name=name)
        out["broadcast", root] = ([b.numpy()], _last_bytes(name))
        col.reduce(r, dst_rank=root, group_name=name)
        out["reduce", root] = ([r.numpy()], _last_bytes(name))
    gathered = [torch.zeros(5, dtype=torch.float64) for _ in range(world)]
    col.allgather(gathered, torch.tensor(values(rank, 5, 4)), group_name=name)
    out["allgather"] = ([g.numpy() for g in gathered], _last_bytes(name))
    scattered = torch.zeros(5, dtype=torch.float64)
    col.reducescatter(scattered, [torch.tensor(values(rank * world + t, 5, 5)) for t in range(world)], group_name=name)
    out["reducescatter"] = ([scattered.numpy()], _last_bytes(name))
    blocks = [torch.zeros(3, dtype=torch.float64) for _ in range(world)]
    hetccl_ray.alltoall([torch.full((3,), float(rank * 10 + t), dtype=torch.float64) for t in range(world)], blocks,
                        group_name=name)
    out["alltoall"] = ([t.numpy() for t in blocks], _last_bytes(name))
    try:  # rank 0 calls another op: named on every rank, and the group goes on
        odd = torch.zeros(7)
        col.allreduce(odd, group_name=name) if rank == 0 else col.broadcast(odd, src_rank=0, group_name=name)
        out["mismatch"] = None
    except hetccl_ray.HetCCLMismatchError as exc:
        out["mismatch"] = str(exc)
    col.barrier(group_name=name)
    return out, hetccl_ray.get_group(name).planner.one_hop


def test_rounds_and_checks_in_one_hop(actors):
    """A group whose small rounds and checks go in one hop (one_hop=True): every op against
    numpy, border bytes the one-hop round's, a rank that called another op named on every rank."""
    from hetccl_ray.core import plans
    from hetccl_ray.core.topology import Topology

    results = on_all(actors, "one-hop", _one_hop_ops)
    islands = [island for island, _ in LAYOUTS["three"]]
    topo, world = Topology.from_islands(islands), len(islands)
    assert all(one_hop for _, one_hop in results)
    want = {"allreduce": [np.sum([values(r, 33, 1) for r in range(world)], axis=0)]}
    for root in (0, world - 1):
        want["broadcast", root] = [values(root, 33, 2)]
        want["reduce", root] = [np.sum([values(r, 33, 3) for r in range(world)], axis=0)]
    for rank, (got, _) in enumerate(results):
        for key, expect in want.items():
            if key[0] != "reduce" or key[1] == rank:
                np.testing.assert_array_equal(np.stack(got[key][0]), np.stack(expect), err_msg=f"{key} rank {rank}")
        np.testing.assert_array_equal(np.stack(got["allgather"][0]), np.stack([values(r, 5, 4) for r in range(world)]))
        np.testing.assert_array_equal(got["reducescatter"][0][0],
                                      np.sum([values(r * world + rank, 5, 5) for r in range(world)], axis=0))
        np.testing.assert_array_equal(np.stack(got["alltoall"][0]),
                                      np.stack([np.full(3, r * 10.0 + rank) for r in range(world)]))
        assert got["mismatch"] is not None and "ranks [0] called allreduce" in got["mismatch"], (rank, got["mismatch"])
    for key in ["allreduce", "allgather", "reducescatter", *[k for k in want if k != "allreduce"]]:
        op, root = (key, 0) if isinstance(key, str) else key
        nbytes = 33 * 8 if op in ("allreduce", "broadcast", "reduce") else world * 5 * 8
        assert sum(got[key][1] for got, _ in results) == plans.round_bytes(topo, op, nbytes, root, one_hop=True), key
    crossing = sum(3 * 8 for r in range(world) for t in range(world) if islands[r] != islands[t])
    assert sum(got["alltoall"][1] for got, _ in results) == crossing  # blocks straight, once; rows carry no data


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_allreduce_every_dtype_size_op(actors, name):
    results = on_all(actors, name, sweep_allreduce)
    world, k = len(LAYOUTS[name]), ISLAND_COUNT[name]
    for key in results[0]:
        dtype, n, op, _ = key
        high = 3 if op == "PRODUCT" else 4
        inputs = np.stack([values(r, n, seed_of(dtype, n, op), low=1, high=high) for r in range(world)])
        expect = REDUCE_OPS[op](inputs.astype(dtype) if dtype != "bfloat16" else inputs, axis=0)
        expect = expect.astype(dtype).astype(np.float64) if dtype != "bfloat16" else expect
        for rank in range(world):
            np.testing.assert_array_equal(results[rank][key][0], expect, err_msg=f"{key} rank {rank}")
        size = itemsize(dtype)
        crossings = k * (k - 1) if n * size <= SMALL_BYTES else 2 * (k - 1)  # see small_round.py for the small round
        assert sum(results[r][key][1] for r in range(world)) == across(name, n * size, crossings * n * size), key


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_broadcast_and_reduce_every_root(actors, name):
    results = on_all(actors, name, sweep_rooted)
    world, k = len(LAYOUTS[name]), ISLAND_COUNT[name]
    for key in results[0]:
        kind, dtype, n, root = key
        size = itemsize(dtype)
        if kind == "broadcast":
            for rank in range(world):
                np.testing.assert_array_equal(results[rank][key][0], values(root, n, root))
        else:
            expect = np.max([values(r, n, root + 50) for r in range(world)], axis=0)
            np.testing.assert_array_equal(results[root][key][0], expect)
            for rank in range(world):  # non-root inputs are left as they were
                if rank != root:
                    np.testing.assert_array_equal(results[rank][key][0], values(rank, n, root + 50))
        assert sum(results[r][key][1] for r in range(world)) == across(name, n * size, (k - 1) * n * size), key


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_allgather_and_reducescatter(actors, name):
    results = on_all(actors, name, sweep_gather_scatter)
    world, k = len(LAYOUTS[name]), ISLAND_COUNT[name]
    for key in results[0]:
        kind, dtype, n = key
        size = itemsize(dtype)
        for rank in range(world):
            if kind == "allgather":
                expect = np.stack([values(r, n, 7) for r in range(world)])
            else:
                expect = np.sum([values(r * world + rank, n, 8) for r in range(world)], axis=0)
            np.testing.assert_array_equal(results[rank][key][0], expect, err_msg=f"{key} rank {rank}")
        whole = world * n * size
        assert sum(results[r][key][1] for r in range(world)) == across(name, whole, (k - 1) * whole), key


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_send_recv_every_pair(actors, name):
    results = on_all(actors, name, sweep_sendrecv)
    for dst, got in enumerate(results):
        assert sorted(got) == [r for r in range(len(results)) if r != dst]
        for src, buf in got.items():
            np.testing.assert_array_equal(buf, np.full(5, src * 100.0 + dst))


def _barrier_and_topology(name, rank, world):
    col.barrier(group_name=name)
    group = hetccl_ray.get_group(name)
    return group.island.name, [list(i.ranks) for i in group.topology.islands], group.topology.lanes


def test_islands_come_from_node_labels(actors):
    results = on_all(actors, "three", _barrier_and_topology)
    assert [r[0] for r in results] == ["a", "b", "a", "c", "b", "a"]
    assert results[0][1:] == ([[0, 2, 5], [1, 4], [3]], 1)


def test_flat_groups_use_the_library_they_name(actors):
    """The sweeps above cover both flat libraries: shared memory on one host, Gloo without."""
    for name, library in (("three-flat", "flat shared memory over every rank"), ("two-flat", "flat Gloo over every rank")):
        lines = on_all(actors, name, lambda n, rank, world: hetccl_ray.get_group(n).cost_model())
        assert all(any(library in line for line in rank_lines) for rank_lines in lines), (name, lines)


def test_an_island_on_one_host_steps_in_shared_memory_unless_same_host_is_off(actors):
    """Every island of these groups shares one host: CPU island steps take shared memory, and
    Gloo with ``same_host`` off or in a group of one island, whose vendor op runs without a
    check (the sweeps above check each gives numpy's values)."""
    for name, library in (("three", "shared memory"), ("two", "shared memory"), ("two-tcp", "gloo"), ("one", "gloo")):
        lines = on_all(actors, name, lambda n, rank, world: hetccl_ray.get_group(n).cost_model()[-1])
        sizes = [line.split("(")[1].split(" ")[0] for line in lines]
        assert all(line.endswith(f"{library if size != '1' else 'one rank'} for CPU tensors")
                   for line, size in zip(lines, sizes)), (name, lines)


def test_one_island_costs_no_border_traffic(actors):
    stats = on_all(actors, "one", lambda name, rank, world: hetccl_ray.border_stats(name))
    assert all(s["bytes_sent"] == 0 and s["bytes_received"] == 0 for s in stats)


def _odd_tensors(name, rank, world):
    base = torch.zeros(20)
    strided = base[::2]                      # non-contiguous torch view
    strided.fill_(rank + 1)
    col.allreduce(strided, group_name=name)
    backwards = np.full(9, rank + 1.0)[::-1]  # numpy, negative stride
    col.allreduce(backwards, group_name=name)
    empty = np.zeros(0, dtype=np.float32)
    col.allreduce(empty, group_name=name)
    scalar = torch.tensor(float(rank + 1))   # 0-d
    col.allreduce(scalar, group_name=name)
    matrix = torch.full((3, 4), float(rank + 1))
    col.broadcast(matrix, src_rank=world - 1, group_name=name)
    leaf = torch.full((6,), float(rank + 1), requires_grad=True)  # a parameter: written outside autograd, as c10d
    col.allreduce(leaf, group_name=name)
    ins = [torch.full((2,), float(10 * rank + t), requires_grad=True) for t in range(world)]
    outs = [torch.zeros(2, requires_grad=True) for _ in range(world)]
    hetccl_ray.alltoall(ins, outs, group_name=name)
    graded = (leaf.detach().numpy(), leaf.is_leaf and leaf.grad_fn is None,
              [o.detach().numpy() for o in outs], all(o.is_leaf for o in outs))
    return base.numpy(), backwards.copy(), empty.shape, scalar.item(), matrix.numpy(), graded


def test_odd_tensors(actors):
    results = on_all(actors, "two", _odd_tensors)
    total = sum(range(1, 5))
    for rank, (base, backwards, empty_shape, scalar, matrix, graded) in enumerate(results):
        np.testing.assert_array_equal(base[::2], np.full(10, total))
        np.testing.assert_array_equal(base[1::2], np.zeros(10))  # untouched between the strides
        np.testing.assert_array_equal(backwards, np.full(9, total))
        assert empty_shape == (0,) and scalar == total
        np.testing.assert_array_equal(matrix, np.full((3, 4), 4.0))
        leaf, leaf_kept, outs, outs_kept = graded  # tensors that require grad: values in, autograd untouched
        np.testing.assert_array_equal(leaf, np.full(6, total))
        for sender, got in enumerate(outs):
            np.testing.assert_array_equal(got, np.full(2, 10.0 * sender + rank))
        assert leaf_kept and outs_kept


def _bad_inputs(name, rank, world):
    from ray.util.collective.types import BroadcastOptions

    group = hetccl_ray.get_group(name)
    errors = {}
    cases = {
        "short list": lambda: group.allgather([[torch.zeros(2)] * (world - 1)], [torch.zeros(2)]),
        "ray short list": lambda: col.allgather([torch.zeros(2)] * (world - 1), torch.zeros(2), group_name=name),
        "bad shape": lambda: group.reducescatter([torch.zeros(2)], [[torch.zeros(3)] * world]),
        "root out of range": lambda: group.broadcast([torch.zeros(2)], _opts(BroadcastOptions, root_rank=world)),
        "ray rank out of range": lambda: col.send(torch.zeros(2), world + 3, group_name=name),
        "complex dtype": lambda: col.allreduce(torch.zeros(2, dtype=torch.complex64), group_name=name),
        "bool dtype": lambda: col.allreduce(np.zeros(2, dtype=bool), group_name=name),
        "not a tensor": lambda: group.allreduce([[1.0, 2.0]]),
        "no such group": lambda: col.allreduce(torch.zeros(2), group_name="no-such-group"),
        "multi tensor": lambda: group.allreduce([torch.zeros(2), torch.zeros(2)]),
    }
    for what, call in cases.items():
        try:
            call()
            errors[what] = None
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            errors[what] = f"{type(exc).__name__}: {exc}"
    col.barrier(group_name=name)  # the group still works after refused input
    return errors


def _opts(cls, **fields):
    opts = cls()
    for key, value in fields.items():
        setattr(opts, key, value)
    return opts


def test_bad_input_gives_clear_errors(actors):
    errors = on_all(actors, "two", _bad_inputs)[0]
    expect = {
        "short list": "list of world_size=4",
        "ray short list": "must be equal to world_size",
        "bad shape": "with 3 elements; expected torch.float32 on cpu with 2",
        "root out of range": "broadcast root 4 is not a rank",
        "ray rank out of range": "must be less than world size",
        "complex dtype": "unsupported dtype torch.complex64 for a reduction; supported: float16, bfloat16",
        "bool dtype": "unsupported numpy dtype bool",
        "not a tensor": "unsupported tensor type list",
        "no such group": "'no-such-group' is not initialized",
        "multi tensor": "takes one tensor per rank",
    }
    for what, text in expect.items():
        assert errors[what] is not None and text in errors[what], (what, errors[what])


def _allreduce_unless_last(name, rank, world):
    col.barrier(group_name=name)
    if rank == world - 1:
        return None
    started = time.monotonic()
    try:
        col.allreduce(torch.ones(8), group_name=name)
    except hetccl_ray.HetCCLError as exc:  # a timeout, or the border of a rank that timed out closing
        return time.monotonic() - started, str(exc)
    return "no error"


def test_missing_peer_times_out_naming_op_and_rank(actors):
    picks = LAYOUTS["two"]
    group = [actors[island][i] for island, i in picks]
    hetccl_ray.create_collective_group(group, 4, [0, 1, 2, 3], group_name="late", timeout_s=3)
    results = ray.get([a.call.remote(_allreduce_unless_last, "late", r, 4) for r, a in enumerate(group)],
                      timeout=60)
    for elapsed, message in results[:3]:
        assert elapsed < 3 + 2, message
        assert "allreduce #2 in group 'late'" in message and "did not arrive: [3]" in message, message


def test_rank_that_never_joins_is_named(actors):
    group = members(actors, "two")[:3]
    started = time.monotonic()
    with pytest.raises(hetccl_ray.HetCCLTimeoutError) as failed:  # formed on every actor before it returns
        hetccl_ray.create_collective_group(group, 4, [0, 1, 2], group_name="short", timeout_s=2)
    message = str(failed.value)
    assert time.monotonic() - started < 2 + 10, message
    assert "forming group 'short'" in message and "did not arrive: [3]" in message, message
    assert "rank 0" in message, message


def _init_inside(name, rank, world):
    col.init_collective_group(world, rank, backend="hetccl", group_name=name)
    x = np.arange(6, dtype=np.int64) * (rank + 1)
    col.allreduce(x, group_name=name)
    col.destroy_collective_group(name)
    return x


def test_init_collective_group_inside_actors(actors):
    hetccl_ray.set_group_options("inside", timeout_s=30)
    results = on_all(actors, "three", lambda name, rank, world: _init_inside("inside", rank, world))
    for x in results:
        np.testing.assert_array_equal(x, np.arange(6) * 21)


def test_ray_create_collective_group_directly(actors):
    """Plain Ray code, no hetccl_ray call: the worker setup hook registered the backend."""
    group = members(actors, "two")
    col.create_collective_group(group, 4, [3, 2, 1, 0], backend="hetccl", group_name="plain")
    results = ray.get([a.call.remote(_allreduce_rank, "plain") for a in group], timeout=120)
    assert [r[0] for r in results] == [3, 2, 1, 0]
    for _, x in results:
        np.testing.assert_array_equal(x, np.full(4, 10.0))


def _allreduce_rank(name):
    col.barrier(group_name=name)  # a declared group forms on its first collective call
    rank = col.get_rank(name)
    x = np.full(4, rank + 1.0)
    col.allreduce(x, group_name=name)
    return rank, x


def test_register_twice_is_harmless():
    hetccl_ray.register()
    hetccl_ray.register()
    from ray.util.collective.backend_registry import _global_registry

    assert _global_registry.get("hetccl") is hetccl_ray.HetCCLGroup


# -- compression ---------------------------------------------------------------------------------

def _gradients_across(name, rank, world, rounds):
    """Allgather real bf16 gradients (bits compared exactly), then allreduces of them; the byte
    and wire counters of the allgather and each link's compression report after all."""
    from hetccl_ray.tools.benchdata import rank_data

    x = rank_data("grads", rank, 1 << 18, torch.bfloat16)
    outs = [torch.zeros_like(x) for _ in range(world)]
    before = hetccl_ray.border_stats(name)
    col.allgather(outs, x, group_name=name)
    after = hetccl_ray.border_stats(name)
    for _ in range(rounds):
        col.allreduce(x.clone(), group_name=name)
    return (x.view(torch.int16).numpy(), [o.view(torch.int16).numpy() for o in outs],
            after["bytes_sent"] - before["bytes_sent"],
            after["wire_bytes_sent"] - before["wire_bytes_sent"], hetccl_ray.border_stats(name)["compression"])


def test_compression_is_bit_exact_on_gradients_and_sends_fewer_bytes(actors):
    results = on_all(actors, "two-zip", _gradients_across, 0)
    inputs = [r[0] for r in results]
    for rank, (_, outs, _, _, report) in enumerate(results):
        for r, got in enumerate(outs):
            np.testing.assert_array_equal(got, inputs[r], err_msg=f"rank {rank} chunk {r}")
        used = [link for link in report.values() if link["messages_compressed"]]
        assert used and all(link["compressing"] and link["ratio"] for link in used), report
    sent, wire = sum(r[2] for r in results), sum(r[3] for r in results)
    assert sent == 4 * (1 << 18) * 2  # (k - 1) S: the bound, counted in payload bytes
    assert wire <= 0.75 * sent, (wire, sent)


def test_auto_measures_then_stays_raw_on_loopback(actors):
    same_host = [r[4] for r in on_all(actors, "two", _gradients_across, 2)]
    assert all(link["mode"] == "off" and not link["messages_compressed"]  # Unix sockets: never encoded
               for report in same_host for link in report.values()), same_host
    reports = [r[4] for r in on_all(actors, "two-tcp", _gradients_across, 12)]
    links = [link for report in reports for link in report.values() if link["messages_compressed"]]
    assert links, reports  # the first large message to each peer measured the codec
    for link in links:
        assert link["mode"] == "auto" and link["encode_MBps"] and not link["compressing"], link
        assert link["link_MBps"] is None or link["link_MBps"] > link["encode_MBps"], link  # None: no 1 MiB sample
        assert link["messages_raw"] > link["messages_compressed"], link


def _after_ray_set_the_class_defaults(name, rank, world):
    """Ray's own ``col.allreduce(op=MAX)`` / ``col.broadcast(src_rank=r)`` set those on the
    options classes; half the ranks here have done so. Forming a group (which calibrates by
    its own ops) and calling it without options must still agree across ranks."""
    if rank % 2:
        col.types.AllReduceOptions.reduceOp = col.types.ReduceOp.MAX
        col.types.BroadcastOptions.root_rank = world - 1
    try:
        col.init_collective_group(world, rank, backend="hetccl", group_name=name)
        x = np.full(3, rank + 1.0)
        hetccl_ray.get_group(name).allreduce(x)
        col.destroy_collective_group(name)
        return x
    finally:
        col.types.AllReduceOptions.reduceOp = col.types.ReduceOp.SUM
        col.types.BroadcastOptions.root_rank = 0


def test_ray_mutating_its_option_classes_does_not_split_the_group(actors):
    hetccl_ray.set_group_options("drift", timeout_s=30)
    results = on_all(actors, "two", lambda name, rank, world: _after_ray_set_the_class_defaults("drift", rank, world))
    for x in results:
        np.testing.assert_array_equal(x, np.full(3, 10.0))
