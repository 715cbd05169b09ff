"""Simulated slow inter-island links: each island's Ray node in its own network namespace.

Namespaces hang off one bridge through veth pairs; ``tc tbf`` shapes both directions of
every veth, so traffic between islands goes at ``rate`` while traffic inside an island
(one namespace) stays unshaped: the shape of a cluster whose cross-vendor links are slower
than its intra-vendor ones; with ``delay``, ``tc netem`` also holds every packet that long
each way (a border between buildings or regions). Needs root and iproute2 (``ip``, ``tc``).
Only the processes it started are stopped (by process group), and its namespaces, veths and
bridge are always removed; Ray's "current cluster" file, which ``ray start --head`` points
at the new head, is left as it was found (as ``ray stop`` does), so a plain ``ray.init()``
afterwards starts a cluster of its own. Traffic stays inside these namespaces and the bridge.

    python -m hetccl_ray.tools.shaped_cluster --layout 2x2 --rate 1gbit   # stand one up, print it
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

import ray
from ray._common.utils import get_ray_address_file  # the "current cluster" file `ray start` writes

from hetccl_ray.tools.local_cluster import REPO, island_names, parse_layout, place_workers
from hetccl_ray.core.topology import ISLAND_LABEL

SUBNET = "10.213"  # addresses of this machine's own test namespaces only
HEAD_GRACE_S = 3.0  # see __exit__
_STARTED = itertools.count()  # clusters this process has made (a deleted veth can linger a moment)


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def restore_pointer(path: str, found: Optional[str], ours: str) -> None:
    """Leave Ray's "current cluster" file ``path`` as a cluster at ``ours`` found it
    (``found``: its text then, None for no file), unless it names another cluster by now."""
    if _read(path) != ours:
        return
    if found is None:
        os.remove(path)
        return
    with open(path, "w") as f:
        f.write(found)


class ShapedClusterUnavailable(RuntimeError):
    """The machine cannot host shaped namespaces (not root, no iproute2, no netns)."""


def _run(*cmd: str) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {result.stderr.strip()}")


def check_available() -> None:
    """Raise :class:`ShapedClusterUnavailable` saying what is missing."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ShapedClusterUnavailable(f"shaped links need iproute2; missing {missing} (apt-get install iproute2)")
    if os.geteuid() != 0:
        raise ShapedClusterUnavailable("shaped links need root (network namespaces, veth, tc)")
    probe = f"hcprobe{os.getpid()}"
    try:
        _run("ip", "netns", "add", probe)
    except RuntimeError as exc:
        raise ShapedClusterUnavailable(f"cannot create network namespaces here: {exc}") from None
    _run("ip", "netns", "del", probe)


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ShapedCluster:
    """Context manager like :class:`~hetccl_ray.tools.local_cluster.LocalCluster`, with shaped links."""

    def __init__(self, islands: Sequence[str], rate: str, burst: str = "256kb", cpus_per_node: int = 1,
                 delay: Optional[str] = None) -> None:
        self.islands = list(dict.fromkeys(islands))
        self.rate, self.burst, self.cpus, self.delay = rate, burst, cpus_per_node, delay
        tag = (os.getpid() + 7919 * next(_STARTED)) % 100000  # names of one process's clusters differ too
        self.net = f"{SUBNET}.{tag % 250}"
        self.bridge = f"hcbr{tag}"
        self.namespaces = [f"hc{tag}-{i}" for i in range(len(self.islands))]
        self.veths = [f"hcv{tag}x{i}" for i in range(len(self.islands))]
        self.head_ip = f"{self.net}.1"
        self.address: Optional[str] = None
        self._procs: list[subprocess.Popen] = []
        self._made: list[tuple[str, ...]] = []
        self.logdir = tempfile.mkdtemp(prefix="hetccl-shaped-")
        self._pointer = get_ray_address_file(None)
        self._found = _read(self._pointer)  # what `ray start --head` overwrites, put back on exit

    def island_ip(self, index: int) -> str:
        return f"{self.net}.{10 + index}"

    def _network(self) -> None:
        _run("ip", "link", "add", "name", self.bridge, "type", "bridge")
        self._made.append(("ip", "link", "del", self.bridge))
        _run("ip", "addr", "add", f"{self.head_ip}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for i, (ns, veth) in enumerate(zip(self.namespaces, self.veths)):
            _run("ip", "netns", "add", ns)
            self._made.append(("ip", "netns", "del", ns))
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "link", "set", veth, "master", self.bridge, "up")
            inside = ("ip", "netns", "exec", ns)
            _run(*inside, "ip", "link", "set", "lo", "up")
            _run(*inside, "ip", "addr", "add", f"{self.island_ip(i)}/24", "dev", "eth0")
            _run(*inside, "ip", "link", "set", "eth0", "up")
            for tc in ((*inside, "tc", "qdisc", "add", "dev", "eth0"),   # leaving the island
                       ("tc", "qdisc", "add", "dev", veth)):                # entering the island
                if self.delay:
                    _run(*tc, "root", "handle", "1:", "netem", "delay", self.delay, "limit", "100000")
                _run(*tc, *(("parent", "1:1", "handle", "10:") if self.delay else ("root",)),
                     "tbf", "rate", self.rate, "burst", self.burst, "latency", "10ms")

    def _start(self, cmd: list[str], namespace: Optional[str] = None) -> None:
        env = {**os.environ, "RAY_AUTH_MODE": "disabled",
               "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
        if namespace:  # Ray's gloo picks its interface from the hostname (127.0.0.1) otherwise
            env["GLOO_SOCKET_IFNAME"] = "eth0"
        prefix = ["ip", "netns", "exec", namespace] if namespace else []
        log = open(os.path.join(self.logdir, f"ray-{len(self._procs)}-{namespace or 'head'}.log"), "w")
        self._procs.append(subprocess.Popen(prefix + cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True))
        log.close()

    def __enter__(self) -> "ShapedCluster":
        check_available()
        try:
            self._network()
            ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
            port = _free_port(self.head_ip)
            self.address = f"{self.head_ip}:{port}"
            self._start([ray_bin, "start", "--head", "--block", f"--node-ip-address={self.head_ip}",
                         f"--port={port}", "--num-cpus=0", "--include-dashboard=false", "--disable-usage-stats"])
            self._wait_nodes(1)
            for i, name in enumerate(self.islands):
                self._start([ray_bin, "start", "--block", f"--address={self.address}",
                             f"--node-ip-address={self.island_ip(i)}", f"--num-cpus={self.cpus}",
                             f"--labels={ISLAND_LABEL}={name}", "--disable-usage-stats"], self.namespaces[i])
                self._wait_nodes(2 + i)  # one at a time: concurrent starts time out on 2 cores
            os.environ["RAY_AUTH_MODE"] = "disabled"
            ray.init(address=self.address, namespace="hetccl", log_to_driver=False, runtime_env={
                "worker_process_setup_hook": "hetccl_ray.setup_worker",
                "env_vars": {"RAY_AUTH_MODE": "disabled", "PYTHONPATH": REPO}})
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_nodes(self, count: int, timeout_s: float = 120.0) -> None:
        """Wait until ``count`` nodes answer ``ray status``-like queries from the GCS."""
        from ray._raylet import GcsClient

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = [i for i, proc in enumerate(self._procs) if proc.poll() is not None]
            if dead:
                logs = sorted(os.listdir(self.logdir))
                tail = open(os.path.join(self.logdir, logs[dead[0]])).read()[-2000:]
                raise RuntimeError(f"a ray process of the shaped cluster exited during start-up:\n{tail}")
            try:
                alive = [n for n in GcsClient(address=self.address).get_all_node_info(timeout=2).values()
                         if n.state == 0]
                if len(alive) >= count:
                    return
            except Exception:  # noqa: BLE001 - the GCS is not up yet
                pass
            time.sleep(0.5)
        raise TimeoutError(f"shaped cluster: {count} nodes did not come up within {timeout_s:.0f}s")

    def workers(self, island_of_rank: Sequence[str]) -> list:
        return place_workers(island_of_rank)

    def __exit__(self, *exc: object) -> None:
        if ray.is_initialized():
            ray.shutdown()
        # islands first, each within a second; then the head, whose GCS and raylet on SIGTERM
        # wait on each other for about 30 s: what is left of it after HEAD_GRACE_S is killed
        for proc in reversed(self._procs):
            _stop(proc, HEAD_GRACE_S if proc is self._procs[0] else 15.0)
        self._procs.clear()
        for cmd in reversed(self._made):
            subprocess.run(cmd, capture_output=True)
        self._made.clear()
        if self.address is not None:
            restore_pointer(self._pointer, self._found, self.address)


def _stop(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM ``proc``'s process group; SIGKILL what is left of it after ``grace_s``."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):  # its last process may have exited just now
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", default="2x2")
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--hold", type=float, default=0.0, help="seconds to keep it up (0: until Ctrl-C)")
    args = parser.parse_args(argv)
    islands = island_names(parse_layout(args.layout))
    with ShapedCluster(islands, args.rate) as cluster:
        print(f"shaped cluster up at {cluster.address}: islands {cluster.islands} in namespaces "
              f"{cluster.namespaces}, inter-island links {args.rate}", flush=True)
        try:
            time.sleep(args.hold) if args.hold else signal.pause()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
