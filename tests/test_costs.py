"""The cost model alone: thresholds follow the measured hop time and bandwidth the way the
formula says, and measuring from timed rounds inverts the model."""

from __future__ import annotations

import math
import pytest
import torch

from hetccl_ray.core import costs
from hetccl_ray.core.topology import Topology

TWO_BY_TWO = Topology.from_islands(["a", "a", "b", "b"])
THREE = Topology.from_islands(["a", "b", "a", "c", "b", "a"])


def test_every_op_has_a_threshold_that_grows_with_hop_time_and_bandwidth():
    base = costs.thresholds(TWO_BY_TWO, costs.LinkCosts(100e-6, 1e9))
    slower_hops = costs.thresholds(TWO_BY_TWO, costs.LinkCosts(200e-6, 1e9))
    slow_link = costs.thresholds(TWO_BY_TWO, costs.LinkCosts(100e-6, 0.125e9))  # a 1 Gbit/s border
    assert set(base) == set(costs.OPS)
    for op in costs.OPS:
        assert 0 < base[op] <= costs.MAX_SMALL_BYTES
        assert slower_hops[op] == pytest.approx(2 * base[op], abs=2)  # whole bytes
        assert slow_link[op] == pytest.approx(base[op] / 8, abs=2)


def _one_hop_busiest(op: str, n: int) -> float:
    """Buffers the busiest rank of the one-hop round moves (rounds.py): the root sends its
    buffer to, or folds one from, each other rank; allreduce folds every other rank's;
    allgather and reduce-scatter pass an S/n block to each other rank."""
    return {"allreduce": n - 1, "reduce": n - 1, "broadcast": n - 1,
            "allgather": (n - 1) / n, "reducescatter": (n - 1) / n}[op]


@pytest.mark.parametrize("one_hop", [False, True])
def test_the_threshold_is_where_both_plans_cost_the_same(one_hop):
    link = costs.LinkCosts(150e-6, 0.8e9)
    for topo in (TWO_BY_TWO, THREE):
        for op, size in costs.thresholds(topo, link, one_hop=one_hop).items():
            hops, tree_c, plan_c = costs._shape(op, topo)
            round_hops, tree_c = (1, _one_hop_busiest(op, topo.world_size)) if one_hop else (3, tree_c)
            plan_c *= costs.PLAN_SOFTWARE
            tree_s = round_hops * link.hop_s + tree_c * size / link.bytes_per_s
            plan_s = hops * link.hop_s + plan_c * size / link.bytes_per_s
            if size < costs.MAX_SMALL_BYTES and tree_c - plan_c >= 0.25:  # the round dearer per byte
                assert tree_s == pytest.approx(plan_s, rel=1e-3), op


@pytest.mark.parametrize("one_hop", [False, True])
def test_measure_inverts_the_model(one_hop):
    hop, rate, sizes, round_hops = 120e-6, 1.5e9, (64 << 10, 1 << 20), 1 if one_hop else 3
    busiest = _one_hop_busiest("broadcast", 4) if one_hop else 3  # root's leader: in, to a leader, to a member
    rounds = [round_hops * hop * f for f in (1.1, 1.0, 1.3)]  # other work only slows a round
    broadcasts = {size: [round_hops * hop + busiest * size / rate + noise for noise in (1e-5, 0.0, 5e-5)]
                  for size in sizes}
    measured = costs.measure(rounds, broadcasts, TWO_BY_TWO, one_hop)
    assert measured.hop_s == pytest.approx(hop) and measured.bytes_per_s == pytest.approx(rate)
    assert "120 us" in measured.describe() and "1.50 GB/s" in measured.describe()


def test_a_noisy_slope_gives_a_bounded_rate_and_threshold():
    flat = costs.measure([3e-4] * 3, {1 << 16: [1e-3] * 3, 1 << 20: [0.9e-3] * 3}, TWO_BY_TWO)  # larger faster
    assert flat.bytes_per_s == 10e9
    assert max(costs.thresholds(TWO_BY_TWO, flat).values()) == costs.MAX_SMALL_BYTES


def test_unknown_op_is_refused():
    with pytest.raises(ValueError, match="no cost model for 'alltoall'"):
        costs.tree_busiest("alltoall", TWO_BY_TWO)


def test_measure_flat_inverts_its_model():
    hop, rate, busiest = 80e-6, 3e9, 3  # a broadcast from the root of 4 ranks sends 3 buffers
    broadcasts = {size: [hop + busiest * size / rate] * 3 for size in (64 << 10, 1 << 20)}
    measured = costs.measure_flat(broadcasts, 4)
    assert costs.measure_flat(broadcasts, 4, [3e-4, 2e-4]).hop_s == 2e-4  # timed tiny broadcasts, where given
    assert measured.hop_s == pytest.approx(hop) and measured.bytes_per_s == pytest.approx(rate)


def test_the_planner_takes_the_round_then_the_flat_plan_only_with_rows_on_the_host():
    from hetccl_ray.core import planner

    p = planner.Planner(TWO_BY_TWO, dict.fromkeys(costs.OPS, 1000), flat=True,
                        flat_from=dict.fromkeys(costs.OPS, 5000.0))
    assert p.plan_of("allreduce", 1000) == planner.ROUND
    assert p.plan_of("allreduce", 4000) == planner.PLAN
    assert p.plan_of("allreduce", 5000) == planner.FLAT
    assert p.plan_of("allreduce", 5000, every_rank_on_host=False) == planner.PLAN  # a GPU somewhere
    assert p.plan_of("allreduce", 5000, checked=False) == planner.PLAN  # no rows: devices unknown
    assert any("flat Gloo over every rank" in line and "allreduce >= 5,000 B" in line for line in p.describe())


def _op(name: str, numel: int = 250, *, peer=None, counts: bool = False, offered=None):
    import torch

    from hetccl_ray.core.calls import Call
    from hetccl_ray.core.op import Op

    buf = torch.zeros(numel) if name != "barrier" else None
    return Op(Call(name, torch.float32, numel if buf is not None else 0), buf, peer=peer, agrees_counts=counts,
              offered=offered)


def test_the_planner_chooses_how_every_op_runs_from_agreed_facts_alone():
    """Planner.choose, the one place the path of an op is decided, against the rules written
    out: messages and groups of one alone; the round up to the threshold; one island's vendor
    op only on an agreed class (not for host calls the round takes, nor with strict); the
    check before everything else unless calls are not checked, but always for all-to-all,
    barrier and a class not yet agreed."""
    from hetccl_ray.core import planner as pl

    one_island = Topology.from_islands(["a", "a", "a"])
    two = pl.Planner(TWO_BY_TWO, dict.fromkeys(costs.OPS, 1000), flat=True, flat_from=dict.fromkeys(costs.OPS, 5000.0))
    alone = pl.Planner(one_island, dict.fromkeys(costs.OPS, 1000))
    c = lambda p, op, host=True, agreed=True: (lambda x: (x.path, x.plan))(p.choose(op, host, agreed))  # noqa: E731
    assert c(two, _op("allreduce", 250)) == (pl.SMALL, pl.ROUND)  # 1,000 B: the round
    assert c(two, _op("allreduce", 1000)) == (pl.CHECKED, pl.PLAN)
    assert c(two, _op("allreduce", 1250)) == (pl.CHECKED, pl.FLAT)  # flat once the rows show host memory
    assert c(two, _op("allgather", 62)) == (pl.SMALL, pl.ROUND)  # 62 x 4 ranks x 4 B: the whole buffer counts
    assert c(two, _op("allgather", 250)) == (pl.CHECKED, pl.PLAN)
    assert c(two, _op("send", 10 ** 6, peer=2)) == (pl.POSTED, None)  # host: posted straight
    assert c(two, _op("send", 10 ** 6, peer=2), host=False) == (pl.DIRECT, None)
    assert c(two, _op("alltoall", 4, counts=True)) == (pl.CHECKED, None)
    assert c(two, _op("barrier")) == (pl.CHECKED, None)
    unchecked = pl.Planner(TWO_BY_TWO, dict.fromkeys(costs.OPS, 1000), check_calls=False)
    assert c(unchecked, _op("broadcast", 250)) == (pl.SMALL, pl.TWO_HOP)
    assert c(unchecked, _op("allreduce", 250)) == (pl.SMALL, pl.ROUND)  # the round carries rows anyway
    assert c(unchecked, _op("allreduce", 10 ** 6)) == (pl.UNCHECKED, pl.PLAN)
    assert c(unchecked, _op("alltoall", 4, counts=True)) == (pl.CHECKED, None)  # its block sizes need the rows
    assert c(unchecked, _op("barrier")) == (pl.CHECKED, None)  # the check is the barrier
    # one island: the vendor op alone once its device class is agreed
    assert c(alone, _op("allreduce", 10 ** 6), host=False, agreed=False) == (pl.CHECKED, pl.PLAN)
    assert c(alone, _op("allreduce", 10 ** 6), host=False) == (pl.VENDOR, pl.PLAN)
    assert c(alone, _op("allreduce", 250), host=False) == (pl.VENDOR, pl.ROUND)  # device: no host round
    assert c(alone, _op("allreduce", 250)) == (pl.SMALL, pl.ROUND)  # host: the round beats the library
    assert c(alone, _op("allreduce", 10 ** 6)) == (pl.VENDOR, pl.PLAN)
    assert c(alone, _op("alltoall", 4, counts=True), host=False) == (pl.CHECKED, None)
    unchecked_alone = pl.Planner(one_island, dict.fromkeys(costs.OPS, 1000), check_calls=False)
    assert c(unchecked_alone, _op("allreduce", 10 ** 6), agreed=False) == (pl.CHECKED, pl.PLAN)  # a new class
    strict = pl.Planner(one_island, dict.fromkeys(costs.OPS, 1000), strict=True)
    assert c(strict, _op("allreduce", 10 ** 6), host=False) == (pl.CHECKED, pl.PLAN)
    assert c(pl.Planner(Topology.from_islands(["a"])), _op("allreduce", 10 ** 6)) == (pl.DIRECT, pl.PLAN)
    # one host: the op's host buffers go with its check
    shm = pl.shared_memory(TWO_BY_TWO)
    assert shm.choose(_op("allreduce", 10, offered=[]), True, True) == pl.Choice(pl.CHECKED, pl.FLAT, True, True)
    assert shm.choose(_op("allreduce", 10, offered=[]), False, True) == pl.Choice(pl.CHECKED, pl.FLAT, False, False)
    assert shm.choose(_op("gather", 10), True, True) == pl.Choice(pl.CHECKED, None, False, True)  # offers nothing


def test_calibration_races_each_op_up_the_ladder_and_keeps_each_winner_where_it_won():
    import collections
    import time

    from hetccl_ray.core import planner

    p = planner.Planner(TWO_BY_TWO)
    k256, m1, m4, m16 = 256 << 10, 1 << 20, 4 << 20, 16 << 20
    # the round takes 0.5 ms, the flat plan 1 ms, the hierarchical 3 ms, except: broadcast's
    # round loses from 1 MiB and its flat op at 1 and 4 MiB, reduce's flat op loses above
    # 256 KiB (a slow border), allreduce's round loses at 4 MiB (to the flat op)
    slow = {(planner.ROUND, "broadcast", m1), (planner.ROUND, "broadcast", m4), (planner.ROUND, "allreduce", m4),
            (planner.FLAT, "broadcast", m1), (planner.FLAT, "broadcast", m4),
            *((planner.FLAT, "reduce", size) for size in (m1, m4, m16))}
    taken = collections.Counter()

    def call(op, nbytes):
        def run():
            plan = p.plan_of(op, nbytes)
            taken[op, nbytes, plan] += 1
            time.sleep(5e-3 if (plan, op, nbytes) in slow else {planner.ROUND: 5e-4, planner.FLAT: 1e-3,
                                                                 planner.PLAN: 3e-3}[plan])
        return run

    def broadcast(t):
        time.sleep(1e-4 + t.numel() * 8 / 1e9 * 3)

    planner.calibrate(p, None, "auto", lambda t: time.sleep(1e-4 + t.numel() * 8 / 2e9 * 3), lambda: time.sleep(3e-4),
                      broadcast, lambda t: None, lambda t, op: t.mul_(4 if op == "sum" else 1),
                      lambda nbytes: {op: call(op, nbytes) for op in costs.OPS})
    every = (planner.ROUND, planner.PLAN, planner.FLAT)
    raced = {**{(op, size): every for op in costs.OPS for size in (k256, m1, m4)},
             ("broadcast", m4): (planner.PLAN, planner.FLAT),  # its round lost at 1 MiB
             **{(op, m16): (planner.PLAN, planner.FLAT) for op in costs.OPS}}
    calls = planner.OP_PROBE_ROUNDS + 1
    assert taken == {(op, size, plan): calls for (op, size), plans in raced.items() for plan in plans}
    # flat from the lowest rung it won every race from (the round still takes what is below its threshold)
    assert p.flat_from == {"allreduce": k256, "reduce": math.inf, "broadcast": m16, "allgather": k256,
                           "reducescatter": k256}
    assert p.small_bytes == {"allreduce": m1, "broadcast": k256, "reduce": m4, "allgather": m4, "reducescatter": m4}
    assert p.plan_of("broadcast", m1) == planner.PLAN and p.plan_of("broadcast", m16) == planner.FLAT
    assert p.plan_of("allreduce", m4) == planner.FLAT and p.plan_of("reduce", 64 << 20) == planner.PLAN
    assert "(three hops)" in p.describe()[1]
    # the header shows what the races measured: every rung and plan raced, a slow one as slow
    assert {(op, size, plan) for op, by_size in p.races.items() for size, times in by_size.items()
            for plan in times} == {(op, size, plan) for (op, size), plans in raced.items() for plan in plans}
    assert p.races["reduce"][m16][planner.FLAT] > p.races["reduce"][m16][planner.PLAN]  # 5 ms against 3
    raced_line = next(line for line in p.describe() if line.startswith("raced reduce"))
    assert f"{m16:,} B plan " in raced_line and " flat " in raced_line


def test_a_race_takes_each_call_on_its_slowest_rank():
    """The flat broadcast's root and its own island finish early; the far island's rank takes
    6 ms where the hierarchical plan takes 2 ms everywhere. Summed over 4 ranks the flat op
    would win (0.1 * 3 + 6 < 2 * 4); on its slowest rank it loses. Every timed call starts
    after a barrier."""
    import time

    from hetccl_ray.core import planner

    p = planner.Planner(TWO_BY_TWO)
    barriers = []
    sleep_s = {planner.FLAT: 1e-4, planner.PLAN: 2e-3}

    def call():
        time.sleep(sleep_s[p.forced])

    def allreduce(t, op):  # this rank and, for every call, the far island's slowest rank
        assert op == "max"
        far = torch.zeros_like(t)
        far[0, 1], far[0, 2] = 2e-3, 6e-3  # [op, (round, plan, flat), call]
        t.copy_(torch.maximum(t, far))

    raced = planner._race(lambda nbytes: {"broadcast": call}, p, lambda: barriers.append(p.forced), allreduce,
                          lambda t: None, 1 << 20, {"broadcast": (planner.PLAN, planner.FLAT)})
    assert raced["broadcast"][planner.FLAT] == pytest.approx(6e-3)
    assert raced["broadcast"][planner.PLAN] == pytest.approx(2e-3, rel=0.5)
    assert min(raced["broadcast"], key=raced["broadcast"].get) == planner.PLAN
    assert barriers == [None] * 2 * (planner.OP_PROBE_ROUNDS + 1)  # before every call, on no forced plan


def test_a_one_hop_group_reads_its_timed_checks_as_one_hop():
    """Calibration times the group's own checks: in one hop each is one hop, not three."""
    import time

    from hetccl_ray.core import planner

    hops = {}
    for one_hop in (False, True):
        p = planner.Planner(TWO_BY_TWO, one_hop=one_hop)
        planner.calibrate(p, None, "off", None, lambda: time.sleep(1.5e-3),
                          lambda t: time.sleep(2e-3 + t.numel() * 8 / 1e9), lambda t: None, lambda t, op: None,
                          lambda nbytes: {op: (lambda: time.sleep(1e-4)) for op in costs.OPS})
        hops[one_hop] = p.link.hop_s
        assert ("(one hop)" if one_hop else "(three hops)") in p.describe()[1]
    assert hops[True] == pytest.approx(3 * hops[False], rel=0.2)  # min of sleeps: close, not equal
    assert 1.5e-3 <= hops[True] < 3e-3


def test_a_slow_flat_library_is_not_taken_beyond_the_sizes_it_raced():
    import time

    from hetccl_ray.core import planner

    p = planner.Planner(TWO_BY_TWO)

    def call(op, nbytes):  # the flat plan wins every race it runs (the round is not faster)
        return lambda: time.sleep({planner.ROUND: 3e-3, planner.FLAT: 1e-3, planner.PLAN: 2e-3}[p.plan_of(op, nbytes)])

    planner.calibrate(p, None, "auto", lambda t: time.sleep(1e-4 + t.numel() * 8 / 2e8),  # 200 MB/s: rungs shrink
                      lambda: time.sleep(3e-4), lambda t: time.sleep(1e-4 + t.numel() * 8 / 3e9), lambda t: None,
                      lambda t, op: t.mul_(4 if op == "sum" else 1),
                      lambda nbytes: {op: call(op, nbytes) for op in costs.OPS})
    assert 1 << 20 < p.flat_until < 16 << 20
    assert p.plan_of("broadcast", int(p.flat_until)) == planner.FLAT
    assert p.plan_of("broadcast", 16 << 20) == planner.PLAN  # beyond what was raced: not extrapolated
    assert any("up to" in line for line in p.describe())


def test_the_round_threshold_follows_its_races_and_the_model_between_them():
    from hetccl_ray.core import planner

    sizes = [256 << 10, 1 << 20, 4 << 20]
    assert planner._round_limit(100_000, math.inf, sizes) == 4 << 20  # won every race: the model was timid
    assert planner._round_limit(100_000, math.inf, []) == 100_000  # none fit the budget: the model's
    assert planner._round_limit(4 << 20, float(1 << 20), sizes) == 256 << 10  # lost at 1 MiB
    assert planner._round_limit(100_000, float(256 << 10), sizes) == 100_000  # lost at the first: below it
    assert planner._round_limit(4 << 20, float(256 << 10), sizes) == 128 << 10


def test_a_slow_border_races_at_fewer_and_smaller_sizes():
    from hetccl_ray.core import planner

    fast = costs.LinkCosts(1e-4, 3e9)
    ladder = sorted({*planner.ROUND_PROBE_BYTES, *planner.OP_PROBE_BYTES})
    assert planner._ladder(TWO_BY_TWO, fast, 2e-3) == ladder  # 4 MiB flat broadcast: 2 ms
    assert planner._ladder(TWO_BY_TWO, fast, None) == list(planner.ROUND_PROBE_BYTES)  # no flat library
    slow = costs.LinkCosts(1e-3, 30e6)  # the round fits the budget at 256 KiB only
    calls = len(costs.OPS) * (planner.OP_PROBE_ROUNDS + 1) * 2 * sum(planner.OP_PROBE_BYTES) / max(planner.PROBE_BYTES)
    scale = planner.OP_PROBE_BUDGET_S / (calls * 0.05)  # 4 MiB flat broadcast: 50 ms
    assert planner._ladder(TWO_BY_TWO, slow, 0.05) == sorted({256 << 10, *(int(size * scale)
                                                                          for size in planner.OP_PROBE_BYTES)})
    assert planner._ladder(TWO_BY_TWO, slow, 60.0) == [min(planner.PROBE_BYTES)]  # never below the small probe


def test_the_flat_op_bounds_the_round_only_for_ops_that_may_take_it():
    link, fast_flat = costs.LinkCosts(300e-6, 1e9), costs.LinkCosts(0.0, 2e9)  # a 0 us flat hop: noise's intercept
    alone = costs.thresholds(TWO_BY_TWO, link)
    assert costs.thresholds(TWO_BY_TWO, link, fast_flat) == alone  # the flat plan is taken for no op
    bounded = costs.thresholds(TWO_BY_TWO, link, fast_flat, ["allreduce"])
    assert bounded["allreduce"] < alone["allreduce"] and bounded["reduce"] == alone["reduce"]


class _OneHostSizes:
    """What shm.py's library takes, by size alone (its real thresholds need a formed library):
    all-to-alls up to 1,000 B, pulled above 100 B; messages pulled from 500 B."""

    def takes_alltoall(self, nbytes: int) -> bool:
        return nbytes <= 1000

    def pulls(self, nbytes: int) -> bool:
        return nbytes > 100

    def pulls_message(self, nbytes: int) -> bool:
        return nbytes >= 500


def test_the_planner_routes_messages_and_alltoall_blocks_from_agreed_facts_alone():
    """Messages: device buffers of island peers through the island library; on one host the
    socket (a large host message pulled), unless the peer is routed over RDMA; a host message
    is posted straight unless pulled (in a batch always). All-to-all: shared memory only with
    host rows everywhere and sizes the library takes; host ranks' blocks straight."""
    import torch

    from hetccl_ray.core import planner as pl
    from hetccl_ray.core.calls import Call

    apart = pl.Planner(TWO_BY_TWO, rank=0)
    assert [apart.route(peer, 10, host=False) for peer in (1, 2)] == [pl.ISLAND, pl.BORDER]
    assert [apart.route(peer, 10, host=True) for peer in (1, 2)] == [pl.BORDER, pl.BORDER]
    host = pl.Planner(TWO_BY_TWO, rank=0, routed=frozenset({3}), one_host=_OneHostSizes())
    assert [host.route(2, n, host=True) for n in (499, 500)] == [pl.SOCKET, pl.PULL]
    assert host.route(2, 500, host=False) == pl.SOCKET and host.route(3, 500, host=True) == pl.BORDER
    big = _op("send", 125, peer=2)  # 500 B
    assert host.message(big, True).path == pl.DIRECT and host.message(big, True, batch=True).path == pl.POSTED
    assert host.message(_op("send", 0, peer=2), True, batch=True).path == pl.DIRECT  # nothing to post
    assert host.plan_of("send", 500, peer=2) == "pull" and host.plan_of("send", 500, peer=3) == "p2p"
    assert host.any_source(True) == "ranks [3] are reached over RDMA" and apart.any_source(True) is None
    assert apart.any_source(False) == "the tensor is not in host memory"
    cpu, dev = Call("alltoall", torch.float32, 4).encode(), Call("alltoall", torch.float32, 4, device=1).encode()
    rows = {0: cpu, 1: cpu, 2: dev, 3: cpu}
    assert host.alltoall(rows, 1000, True) == pl.AllToAll(False, frozenset({0, 1, 3}), False)  # a device rank
    assert host.alltoall({**rows, 2: cpu}, 1000, True) == pl.AllToAll(True, frozenset(range(4)), False)
    assert host.alltoall({**rows, 2: cpu}, 1001, True).shared is False  # beyond what the library takes
    assert apart.alltoall(None, 10, False) == pl.AllToAll(False, frozenset(), True)  # no rows: every block routed
    assert [host.plan_of("alltoall", n) for n in (100, 101, 1001)] == [pl.FLAT, "pull", "direct"]
    flat = pl.Choice(pl.CHECKED, pl.FLAT)
    assert host.flat_with(flat, {**rows, 2: cpu}) and not host.flat_with(flat, rows) and not host.flat_with(flat, None)
    assert not host.flat_with(pl.Choice(pl.CHECKED, pl.PLAN), {**rows, 2: cpu})
