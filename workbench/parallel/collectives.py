"""What a collective costs: the bytes one rank sends under bandwidth-optimal (ring) algorithms.

One convention everywhere (plans, the SPMD byte counter, each parallelism's formula): ``full_bytes``
is the size of the whole (gathered / reduced) buffer ``N`` of one call over a group of ``n`` ranks::

    all_gather      each rank contributes N/n, receives the rest      (n-1)/n * N
    reduce_scatter  input N, keeps N/n                                (n-1)/n * N
    all_reduce      a reduce-scatter then an all-gather               2 (n-1)/n * N
    all_to_all      N = the send buffer; its own 1/n stays home       (n-1)/n * N
    broadcast       pipelined ring, averaged over ranks               (n-1)/n * N
    send/recv       point to point                                    N

This is the volume DTensor's own cost model charges. A group of one rank moves nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ring_bytes", "full_buffer_bytes", "Collective", "COLLECTIVES"]

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "send/recv")


def ring_bytes(collective: str, full_bytes: float, n: int) -> float:
    """Bytes one rank sends for one call of ``collective`` over ``n`` ranks on an ``N``-byte buffer."""
    if collective not in COLLECTIVES:
        raise ValueError(f"collective={collective!r} is unknown; choose one of {list(COLLECTIVES)}")
    if collective == "send/recv":
        return float(full_bytes)
    if n <= 1:
        return 0.0
    if collective == "all_reduce":
        return 2 * (n - 1) / n * full_bytes
    return (n - 1) / n * full_bytes


def full_buffer_bytes(collective: str, input_bytes: int, n: int) -> int:
    """``N`` of a call seen from one rank's input: an all-gather's input is the shard (N = n x input)."""
    return input_bytes * n if collective == "all_gather" else input_bytes


@dataclass(frozen=True)
class Collective:
    """One kind of call a training step makes: ``calls`` of ``collective`` on an ``N``-byte buffer.

    Each parallelism's module lists the collectives its technique makes (``*_comm`` functions next to
    its ``apply_*``); ``workbench.plan.comm`` adds them up per rank.
    """

    collective: str
    mesh_dim: str
    phase: str                 # forward, backward, optimizer
    full_bytes: float          # N of one call
    group_size: int
    calls: int
    what: str

    @property
    def bytes_per_rank(self) -> float:
        """What one rank sends over all ``calls``."""
        return ring_bytes(self.collective, self.full_bytes, self.group_size) * self.calls
