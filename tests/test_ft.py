"""hetccl as torchft's process group (doors/ft.py): replica groups on two islands train under
torchft's real Manager and Lighthouse (spawned processes, real sockets), one replica per rank
or an island as one replica group; ranks and whole islands killed with SIGKILL in the middle
of an allreduce come back and are healed, and every rank's final weights equal a one-process
replay of the log of (step, participating replicas) within 1e-5."""

from __future__ import annotations

import multiprocessing
import queue as queues
import socket
import time

import numpy as np
import pytest

torchft = pytest.importorskip("torchft", reason="torchft is not installed (pip install -e '.[test]')")
from torchft.coordination import LighthouseServer  # noqa: E402

from tests import ft_workers as w  # noqa: E402

DEADLINE_S = 150
ISLANDS = {"a": "island-x", "b": "island-y"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Run:
    """Replica groups of ``group_world`` ranks each, one per island, under one Lighthouse;
    ``kills``: replica -> the steps at which its ranks kill themselves, one incarnation each
    (the first incarnation dies at the first step, the restarted one at the next, ...)."""

    def __init__(self, steps: int, group_world: int = 1, kills: dict[str, list[int]] | None = None) -> None:
        self.steps, self.group_world, self.kills = steps, group_world, kills or {}
        self.lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=2000)
        self.ctx = multiprocessing.get_context("spawn")
        self.events = self.ctx.Queue()
        self.target = self.ctx.Value("i", 1 << 30)  # the step every rank ends at, once set
        self.incarnation = dict.fromkeys(ISLANDS, 0)
        self.start = self.ctx.Barrier(len(ISLANDS) * group_world)  # the first incarnations start together
        self.procs: dict[str, list] = {replica: self._start(replica) for replica in ISLANDS}

    def _start(self, replica: str) -> list:
        kills = self.kills.get(replica, [])
        n = self.incarnation[replica]
        kill_at = kills[n] if n < len(kills) else -1
        port = _free_port() if self.group_world > 1 else 0
        procs = [self.ctx.Process(target=w.rank_main, args=(replica, ISLANDS[replica], self.lighthouse.address(),
                                                            self.target, self.events, 0.05, kill_at, rank,
                                                            self.group_world, port, self.start if n == 0 else None))
                 for rank in range(self.group_world)]
        for proc in procs:
            proc.start()
        return procs

    def run(self) -> tuple[dict[int, list[str]], dict[str, list], list[tuple[str, int]]]:
        """Read events until every rank reported its weights, restarting a replica group whose
        ranks all died; the log {step: replicas}, the final weights by rank, and the (replica,
        step) each death came in."""
        log: dict[int, dict] = {}
        finals: dict[str, list] = {}
        deaths: list[tuple[str, int]] = []
        end = time.monotonic() + DEADLINE_S
        try:
            while len(finals) < len(ISLANDS) * self.group_world:
                if time.monotonic() > end:
                    raise AssertionError(f"ranks did not finish in {DEADLINE_S}s: finished {sorted(finals)}; log {log}")
                for replica, procs in self.procs.items():  # a replica group all dead: Ray would restart it
                    if not any(proc.is_alive() for proc in procs) and not any(
                            name.startswith(f"{replica}/") for name in finals):
                        self.incarnation[replica] += 1
                        self.procs[replica] = self._start(replica)
                try:
                    kind, who, *rest = self.events.get(timeout=0.5)
                except queues.Empty:
                    continue
                if kind == "error":
                    raise AssertionError(f"rank {who} failed: {rest[0]}")
                if kind == "dying":
                    if (who, rest[0]) not in deaths:
                        deaths.append((who, rest[0]))
                    continue
                if kind == "step":
                    step, participants, _ = rest
                    reported = log.setdefault(step, {"by": set(), "participants": participants})
                    reported["by"].add(who)
                    # one count per step, and never more reporters than it: no split brain
                    assert reported["participants"] == participants >= len(reported["by"]), (step, reported)
                    healed = all(any(r["participants"] == len(ISLANDS) for s, r in log.items() if s > died)
                                 for _, died in deaths)
                    kills_done = len(deaths) == sum(map(len, self.kills.values()))
                    if self.target.value == 1 << 30 and step >= self.steps and kills_done and healed:
                        self.target.value = step + 2  # every rank ends there, together
                else:
                    finals[who] = rest[0]
        finally:
            for procs in self.procs.values():
                for proc in procs:
                    proc.kill()
                    proc.join(10)
            self.lighthouse.shutdown()
        # who took part: every replica where the step's allreduce had them all (a rank killed
        # after its contribution left is in a step it never reported), else its one reporter
        return ({step: sorted(ISLANDS) if r["participants"] == len(ISLANDS) else sorted(r["by"])
                 for step, r in log.items()}, finals, deaths)

    def check(self, log: dict[int, list[str]], finals: dict[str, list]) -> None:
        steps = self.target.value
        assert steps >= self.steps and sorted(log) == list(range(steps))  # every step committed once
        expected = w.replay(log, steps, self.group_world)
        for rank, weights in finals.items():
            for got, want in zip(weights, expected):
                np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-6, err_msg=rank)


def test_a_rank_killed_mid_allreduce_comes_back_twice_and_every_step_is_replayed_exactly():
    """One replica per rank: b dies in an allreduce at step 4 or later, comes back, dies again
    at step 9 or later, comes back again; a goes on alone meanwhile and heals b each time."""
    run = _Run(steps=18, kills={"b": [4, 9]})
    log, finals, deaths = run.run()
    assert [who for who, _ in deaths] == ["b", "b"]
    assert any(set(log[s]) == {"a", "b"} for s in range(deaths[-1][1], len(log)))  # b, back, took part again
    run.check(log, finals)


def test_a_whole_island_killed_and_its_replica_groups_rank_0_with_it_comes_back():
    """Islands as replica groups (DDP inside an island over its own Gloo, torchft across
    islands over hetccl): both ranks of island b, its rank 0 running torchft's manager server
    included, die in an allreduce at step 5 or later; island a goes on, and b is healed when
    Ray would have restarted it (here: the test)."""
    run = _Run(steps=14, group_world=2, kills={"b": [5]})
    log, finals, deaths = run.run()
    assert {who for who, _ in deaths} == {"b"}
    assert any(set(log[s]) == {"a", "b"} for s in range(max(step for _, step in deaths), len(log)))
    run.check(log, finals)


def _manager(lighthouse: str, min_replicas: int, store) -> None:
    import datetime

    from torchft import Manager

    from hetccl_ray.doors.ft import ProcessGroupHetCCL

    seconds = datetime.timedelta(seconds=3)
    manager = Manager(pg=ProcessGroupHetCCL(seconds), load_state_dict=lambda state: None, state_dict=lambda: {},
                      min_replica_size=min_replicas, replica_id="lone", lighthouse_addr=lighthouse,
                      store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1, use_async_quorum=False,
                      timeout=seconds, quorum_timeout=seconds, connect_timeout=seconds)
    try:
        manager.start_quorum()
    finally:
        manager.shutdown(wait=False)


def test_no_lighthouse_or_a_quorum_that_cannot_form_is_an_error_within_the_deadline(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("HETCCL_ISLAND", "island-x")
    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="failed to connect"):
        _manager(f"http://127.0.0.1:{_free_port()}", 1, store)  # nobody listens there
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=200)
    try:
        with pytest.raises(TimeoutError, match="Timeout expired"):
            _manager(lighthouse.address(), 2, store)  # a second replica never comes
    finally:
        lighthouse.shutdown()
    assert time.monotonic() - started < 20  # two 3 s deadlines, no hang
