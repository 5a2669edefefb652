"""The nodes of a multi-node run: the settings that bring them together, who joined, and what to say
when one of them goes away.

Every node runs the same command; only ``--node-rank`` differs. Node 0 hosts torchrun's c10d
rendezvous at ``--rdzv-endpoint``; the others find it there. torchrun then numbers the nodes itself (its
GROUP_RANK, in the order of host name and process id), not by ``--node-rank``, so the ranks of the
node started with ``--node-rank 1`` are not always ranks ``nproc..2*nproc-1``.

So each node's launcher (``workbench.train.agent``) keeps a :class:`NodeDirectory` in the rendezvous's
own store: one entry per node with its node rank, host, run directory, settings and, once its ranks
run, their global ranks. Every launcher reads the entries while the nodes are alive. When a node goes
away, the others can then name it, its host, its ranks and where its log is; and a node started with
different settings is refused with the settings that differ.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Callable

from workbench.train.events import LAUNCHER_RANK, EventReader, EventWriter
from workbench.train.outcome import rank_span

__all__ = ["node_settings", "parse_endpoint", "torchrun_args", "NodeDirectory", "DEFAULT_RDZV_ID"]

# The same on every node without anyone typing it: nodes meet by endpoint, and one endpoint serves one job.
DEFAULT_RDZV_ID = "workbench"
TIMEOUT_ENV = "WORKBENCH_RDZV_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0  # how long a node waits for the others (they may be started by hand)
_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_ENDPOINT = re.compile(r"\[(?P<v6>[0-9A-Fa-f:.]+)\]:(?P<p6>\d+)|(?P<host>[^\s:\[\]/]+):(?P<port>\d+)")


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``'node0:29500'`` -> ``('node0', 29500)``; IPv6 as ``'[fe80::1]:29500'``. ValueError naming the fix."""
    m = _ENDPOINT.fullmatch(endpoint.strip()) if isinstance(endpoint, str) else None
    if m is None:
        raise ValueError(f"--rdzv-endpoint {endpoint!r} is not HOST:PORT; give node 0's address and a free port, "
                         "e.g. --rdzv-endpoint node0:29500 or 10.0.0.1:29500")
    host, port = (m["v6"], int(m["p6"])) if m["v6"] else (m["host"], int(m["port"]))
    if not 1 <= port <= 65535:
        raise ValueError(f"--rdzv-endpoint {endpoint!r}: port {port} is outside 1-65535; choose a free port "
                         "such as 29500")
    return host, port


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r} must be an integer")
    return value


def node_settings(nnodes: int = 1, node_rank: int = 0, rdzv_endpoint: str | None = None,
                  rdzv_id: str | None = None, rdzv_timeout_s: float | None = None) -> dict[str, Any] | None:
    """Check the multi-node settings and return what ``JobConfig.nodes`` records: None on one node,
    else ``{"nnodes", "node_rank", "rdzv_endpoint", "rdzv_id", "rdzv_timeout_s"}``. Raises ValueError,
    one line naming the fix. ``rdzv_timeout_s`` defaults to ``$WORKBENCH_RDZV_TIMEOUT_S``, else 300."""
    nnodes, node_rank = _int("nnodes", nnodes), _int("node_rank", node_rank)
    if nnodes < 1:
        raise ValueError(f"--nnodes {nnodes} must be at least 1 (the machines in the job)")
    if nnodes == 1:
        if node_rank != 0:
            raise ValueError(f"--node-rank {node_rank} needs --nnodes {node_rank + 1} or more; for a run on one "
                             "machine drop --node-rank")
        for flag, value in (("--rdzv-endpoint", rdzv_endpoint), ("--rdzv-id", rdzv_id)):
            if value is not None:
                raise ValueError(f"{flag} is for runs over several machines; add --nnodes N (N > 1), or drop {flag}")
        return None
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank {node_rank} is outside 0..{nnodes - 1} for --nnodes {nnodes}; give each "
                         f"machine its own --node-rank from 0 to {nnodes - 1}")
    if rdzv_endpoint is None:
        raise ValueError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT: an address of node 0 that every node "
                         "can reach and a free port there, e.g. --rdzv-endpoint node0:29500")
    host, port = parse_endpoint(rdzv_endpoint)
    rdzv_id = DEFAULT_RDZV_ID if rdzv_id is None else rdzv_id
    if not isinstance(rdzv_id, str) or not _ID.fullmatch(rdzv_id):
        raise ValueError(f"--rdzv-id {rdzv_id!r} must be 1-64 letters, digits, '_', '.' or '-' (e.g. the Slurm "
                         "job id); the same on every node")
    if rdzv_timeout_s is None:
        env = os.environ.get(TIMEOUT_ENV)
        try:
            rdzv_timeout_s = float(env) if env else DEFAULT_TIMEOUT_S
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV}={env!r} is not a number of seconds; set e.g. {TIMEOUT_ENV}=300") from None
    if isinstance(rdzv_timeout_s, bool) or not isinstance(rdzv_timeout_s, (int, float)) or not rdzv_timeout_s > 0:
        raise ValueError(f"--rdzv-timeout {rdzv_timeout_s!r} must be a positive number of seconds (how long a node "
                         "waits for the others)")
    endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return {"nnodes": nnodes, "node_rank": node_rank, "rdzv_endpoint": endpoint, "rdzv_id": rdzv_id,
            "rdzv_timeout_s": float(rdzv_timeout_s)}


def torchrun_args(nodes: dict[str, Any], nproc: int) -> list[str]:
    """torchrun's arguments for this node: the c10d rendezvous at the endpoint, hosted by node 0.

    No ``--node-rank``: c10d ignores it (with a warning) and numbers the nodes itself. ``is_host`` makes
    node 0 host the rendezvous store even when the endpoint's name does not match its own (and keeps
    the other nodes from hosting one on a machine they share with node 0). Timeouts are whole seconds.
    """
    timeout = max(1, math.ceil(nodes["rdzv_timeout_s"]))
    is_host = 1 if nodes["node_rank"] == 0 else 0
    return [f"--nnodes={nodes['nnodes']}", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={nodes['rdzv_endpoint']}", f"--rdzv-id={nodes['rdzv_id']}",
            f"--rdzv-conf=join_timeout={timeout},read_timeout={timeout},is_host={is_host}"]


def _differences(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[tuple[str, Any, Any]]:
    out = []
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            out += _differences(x, y, f"{prefix}{key}.")
        elif x != y:
            out.append((f"{prefix}{key}", x, y))
    return out


def _comparable(job: dict[str, Any]) -> dict[str, Any]:
    """The settings every node must share: the job without this node's own rank and wait."""
    job = json.loads(json.dumps(job))
    for key in ("node_rank", "rdzv_timeout_s"):  # a node's own number; how long it waits harms no one
        (job.get("nodes") or {}).pop(key, None)
    return job


class NodeDirectory:
    """This node's view of every node in the run, kept in the rendezvous store (see the module docstring).

    ``start()`` runs a thread that waits for node 0's rendezvous, writes this node's entry, adds its ranks
    once they have written their first event, and reads the other nodes' entries until every node's ranks
    are known (then it writes one ``nodes`` event and leaves the store alone). It never blocks the
    launcher: a node that cannot reach the store still runs, its reports just know less.
    """

    def __init__(self, nodes: dict[str, Any], nproc: int, run_dir: str, job: dict[str, Any],
                 on_mismatch: Callable[[str], None] | None = None):
        self._on_mismatch = on_mismatch or (lambda message: os.kill(os.getpid(), signal.SIGTERM))
        self.nodes, self.nproc, self.run_dir = nodes, nproc, os.path.abspath(run_dir)
        self.node_rank, self.nnodes = nodes["node_rank"], nodes["nnodes"]
        self.host = socket.gethostname()
        self.entries: dict[int, dict[str, Any]] = {}  # node rank -> its entry, as last read
        self.reached = False  # whether this launcher reached the rendezvous store
        self.mismatch: str | None = None  # set when another node runs different settings
        self._job = _comparable(job)
        self._reader = EventReader(run_dir)
        self._ranks: list[int] | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="workbench-nodes", daemon=True)

    def start(self) -> "NodeDirectory":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2.0)

    # -- what this node knows ---------------------------------------------------------------------
    def local_ranks(self) -> list[int] | None:
        """This node's global ranks, once one of them has written an event (torchrun numbers nodes
        ``g`` with ranks ``g*nproc .. g*nproc+nproc-1``)."""
        with self._read_lock:  # the thread and the agent both ask
            if self._ranks is None:
                ranks = [e["rank"] for e in self._reader.read_new()
                         if isinstance(e.get("rank"), int) and e["rank"] >= 0]
                if ranks:
                    g = min(ranks) // self.nproc
                    self._ranks = list(range(g * self.nproc, (g + 1) * self.nproc))
            return self._ranks

    def known(self) -> dict[int, dict[str, Any]]:
        with self._lock:
            return dict(self.entries)

    # -- the thread -------------------------------------------------------------------------------
    def _key(self, *parts: Any) -> str:
        return "/".join(["workbench", self.nodes["rdzv_id"], *map(str, parts)])

    def _run(self) -> None:
        """Join the directory and follow it. Each node writes ``node/R`` (host, run directory, a hash of
        its settings) and ``job/R`` (the settings) once, ``ranks/R`` once its ranks are known, and counts
        itself in ``joined`` and ``ranked``; readers poll the two counters and read each entry once, so
        the store's load stays small on many nodes."""
        from torch.distributed import TCPStore

        host, port = parse_endpoint(self.nodes["rdzv_endpoint"])
        deadline = time.monotonic() + self.nodes["rdzv_timeout_s"]
        # Wait quietly for node 0's store: a TCPStore client that cannot connect logs a C++ trace.
        while not self._stop.is_set():
            try:
                socket.create_connection((host, port), timeout=1.0).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    return
                self._stop.wait(0.2)
        try:
            store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10), wait_for_workers=False)
            job = json.dumps(self._job, sort_keys=True)
            me = {"node": self.node_rank, "host": self.host, "pid": os.getpid(), "run_dir": self.run_dir,
                  "job_hash": hashlib.sha256(job.encode()).hexdigest()}
            store.set(self._key("job", self.node_rank), job)
            store.set(self._key("node", self.node_rank), json.dumps(me))
            store.add(self._key("joined"), 1)
            self.reached = True
            ranks_written, joined_seen = False, 0
            while not self._stop.is_set():
                if not ranks_written and self.local_ranks() is not None:
                    store.set(self._key("ranks", self.node_rank), json.dumps(self.local_ranks()))
                    store.add(self._key("ranked"), 1)
                    ranks_written = True
                ranked = store.add(self._key("ranked"), 0)  # before joined: every ranked node has joined
                joined = store.add(self._key("joined"), 0)
                if joined != joined_seen:
                    joined_seen = joined
                    new = {n: json.loads(store.get(self._key("node", n))) for n in range(self.nnodes)
                           if n not in self.entries and store.check([self._key("node", n)])}
                    with self._lock:
                        self.entries = {**self.entries, **new}
                    if any(self._check_settings(store, n, e["job_hash"], me["job_hash"]) for n, e in new.items()):
                        return
                if ranked == self.nnodes:
                    ranks = {n: json.loads(store.get(self._key("ranks", n))) for n in range(self.nnodes)}
                    with self._lock:
                        for n, e in self.entries.items():
                            e["ranks"] = ranks[n]
                    with EventWriter(self.run_dir, LAUNCHER_RANK) as ev:
                        ev.emit("nodes", nodes={str(n): {k: e.get(k) for k in ("host", "ranks", "run_dir")}
                                                for n, e in sorted(self.known().items())})
                    return
                self._stop.wait(0.25)
        except Exception as e:  # noqa: BLE001 - e.g. the store went away with node 0; keep what was read
            print(f"workbench: node {self.node_rank} stopped following the node directory: {type(e).__name__}: "
                  f"{str(e).splitlines()[0] if str(e) else ''}", file=sys.stderr, flush=True)

    def _check_settings(self, store: Any, node: int, theirs: str, mine: str) -> bool:
        """Refuse a run whose nodes were started with different settings: say which (:attr:`mismatch`),
        then stop this node (``on_mismatch``; by default SIGTERM, and torchrun stops its ranks)."""
        if node == self.node_rank or theirs == mine:
            return False
        diff = _differences(self._job, json.loads(store.get(self._key("job", node))))
        shown = "; ".join(f"{k}: {a!r} here, {b!r} there" for k, a, b in diff[:3])
        more = f" (and {len(diff) - 3} more)" if len(diff) > 3 else ""
        host = self.entries.get(node, {}).get("host")
        self.mismatch = (f"node {node} (host {host}) runs different settings: {shown}{more}; start every node "
                         "with the same command, only --node-rank differs")
        self._stop.wait(0.5)  # node 0 hosts the store: let the other node read our entry first
        self._on_mismatch(self.mismatch)
        return True

    # -- reports ----------------------------------------------------------------------------------
    def _describe(self, node: int, ranks: list[int] | None = None) -> str:
        e = self.known().get(node, {})
        ranks = ranks if ranks is not None else e.get("ranks")
        parts = [f"node {node}"]
        if ranks:
            parts.append(f"(rank{'s' if len(ranks) > 1 else ''} {rank_span(ranks)}" +
                         (f", host {e['host']})" if e.get("host") else ")"))
        elif e.get("host"):
            parts.append(f"(host {e['host']})")
        return " ".join(parts)

    def other_nodes(self) -> list[int]:
        return [n for n in range(self.nnodes) if n != self.node_rank]

    def lost(self, ranks_here: list[int], rendezvous_lost: bool = False) -> dict[str, Any]:
        """What to report when this node's ranks failed only because another node went away: the
        ``run_end`` fields ``failed_node``, ``failed_rank``, ``lost_ranks`` and ``message``.

        The node is the other one of two; with more, node 0 when the rendezvous it hosts was lost, else
        every other node is named as a suspect (their own logs tell which one it was)."""
        others = self.other_nodes()
        suspects = [0] if rendezvous_lost and self.node_rank != 0 else others
        mine = self.local_ranks() or sorted(ranks_here)
        here = (f"rank{'s' if len(mine) > 1 else ''} {rank_span(mine)} here (node {self.node_rank}) lost "
                f"{'their' if len(mine) > 1 else 'its'} connection to it")
        if len(suspects) == 1:
            node = suspects[0]
            e = self.known().get(node, {})
            world = self.nproc * self.nnodes
            ranks = e.get("ranks") or ([r for r in range(world) if r not in mine] if self.nnodes == 2 else None)
            where = self._log_of(node)
            what = "the rendezvous it hosts is gone, and " if rendezvous_lost else ""
            message = (f"it went away: {what}{here} (a rank there failed, its launcher was stopped or killed, or "
                       f"its machine went down); see node {node}'s log for why: {where}")
            return {"failed_node": node, "failed_rank": min(ranks) if ranks else None, "lost_ranks": ranks,
                    "message": message}
        named = ", ".join(self._describe(n) for n in suspects)
        return {"failed_node": None, "failed_rank": None, "lost_ranks": None,
                "message": f"another node went away: {here}; one of {named} stopped, and its own log "
                           "(launcher.log in its --out) says why"}

    def _log_of(self, node: int) -> str:
        e = self.known().get(node, {})
        if e.get("run_dir"):
            return f"{e['run_dir']}/launcher.log on host {e['host']}"
        return "launcher.log in its run directory (--out)"

    def rendezvous_gone(self) -> dict[str, Any]:
        """What to report when node 0, and the rendezvous it hosts, went away before this node's ranks
        started (``run_end`` fields)."""
        return {"failed_node": 0, "message": f"it went away with the rendezvous at {self.nodes['rdzv_endpoint']} "
                f"before the ranks of node {self.node_rank} started; see node 0's log for why: {self._log_of(0)}"}

    def join_timeout(self) -> str:
        """The one line for a node whose partners did not all come within the timeout (``RunFailed`` says
        which node: ``node 0 failed: waited 60 s at node0:29500 for 2 nodes, 1 joined; ...``)."""
        joined = sorted(self.known()) or [self.node_rank]
        missing = [n for n in range(self.nnodes) if n not in joined]
        ranks = ", ".join(str(n) for n in missing)
        return (f"waited {self.nodes['rdzv_timeout_s']:g} s at {self.nodes['rdzv_endpoint']} "
                f"for {self.nnodes} nodes, {len(joined)} joined; start the same command with --node-rank {ranks} on "
                f"the other node{'s' if len(missing) > 1 else ''} (or raise --rdzv-timeout)")

    def unreachable(self, cause: str) -> str:
        """The one line for a node that could not reach (node 0: could not host) the rendezvous."""
        host, port = parse_endpoint(self.nodes["rdzv_endpoint"])
        if self.node_rank == 0:
            return (f"could not host the rendezvous at {self.nodes['rdzv_endpoint']}: {cause}; run node 0 on the "
                    f"machine at {host}, with a port that is free there (e.g. --rdzv-endpoint {host}:29500)")
        return (f"could not reach the rendezvous at {self.nodes['rdzv_endpoint']} within "
                f"{self.nodes['rdzv_timeout_s']:g} s; start the same command with --node-rank 0 on the machine at "
                f"{host} (node 0 hosts the rendezvous), and check that port {port} is open between the nodes")
