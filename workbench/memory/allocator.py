"""A model of torch's CUDA caching allocator: the memory a sequence of allocations and frees *reserves*.

``torch.cuda.max_memory_allocated()`` counts the blocks handed out; what runs out is
``max_memory_reserved()``, the segments the allocator took from CUDA and keeps cached. This module
replays an ordered sequence of allocations and frees (a :class:`~workbench.memory.timeline.MemoryTimeline`,
predicted or recorded) through the rules of torch's ``c10/cuda/CUDACachingAllocator.cpp`` and says what
the allocator reserves at every event, its peak, how much of it sits unused (fragmentation), how many
segments it holds, and whether it runs out at a given capacity.

The rules modelled (sizes in bytes; MiB = 2**20)::

    request     rounded up to 512 (or to a power-of-two division: roundup_power2_divisions)
    pool        <= 1 MiB: the small pool; larger: the large pool (each per stream)
    new segment small pool: 2 MiB; large: 20 MiB for requests < 10 MiB, else the request rounded up to 2 MiB
    search      best fit among the pool's cached free blocks: the smallest that fits, then the lowest
                address; a block >= max_split_size serves only a request >= max_split_size, and then
                only when it is less than 20 MiB larger (oversize blocks are never split)
    split       small pool: when >= 512 B would remain; large pool: when > 1 MiB would remain and the
                request is < max_split_size (else the whole block is handed out and counted allocated)
    free        the block goes back to its pool, merged with free neighbours of its segment; the
                segment stays reserved (caching)
    out of room (a new segment beyond ``capacity``): free cached oversize blocks (max_split_size set),
                retry; free every cached segment with no block in use, retry; else out of memory
    expandable_segments:True
                one segment per pool and stream that grows by mapping pages (2 MiB in the small pool,
                20 MiB in the large, as torch maps them) at the lowest free address; blocks split
                whenever >= 512 B remain; out of room, whole free pages are unmapped and the search retried

Not modelled: several streams' cross-stream frees (``record_stream`` events: a block is reused at once),
CUDA graphs' private pools, ``garbage_collection_threshold``, per-size-interval
``roundup_power2_divisions`` (one value for all sizes), and memory outside the allocator (the CUDA
context, NCCL's own buffers: :func:`workbench.prediction.memory.fits` adds a margin for those).

Free blocks are kept in sorted lists (a bisect finds the best fit; an insert moves pointers in C), so a
replay is about linear in events: 10^5 events in 0.15 s on one core.
"""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

__all__ = ["AllocatorConfig", "CachingAllocator", "AllocatorReplay", "OutOfMemory", "replay", "replay_timeline",
           "round_size", "allocation_size", "MiB"]

MiB = 1 << 20
MIN_BLOCK = 512               # every block is a multiple of this
SMALL_SIZE = 1 * MiB          # largest request of the small pool
SMALL_BUFFER = 2 * MiB        # the small pool's segments (and its expandable pages)
LARGE_BUFFER = 20 * MiB       # segments for large requests under MIN_LARGE_ALLOC (and the large pool's pages)
MIN_LARGE_ALLOC = 10 * MiB
ROUND_LARGE = 2 * MiB         # larger requests get a segment of their own size rounded up to this
_NO_LIMIT = 1 << 62


class OutOfMemory(Exception):
    """A request the allocator cannot serve within its capacity, after freeing what it caches."""

    def __init__(self, size: int, reserved: int, allocated: int, capacity: int):
        self.size, self.reserved, self.allocated, self.capacity = size, reserved, allocated, capacity
        super().__init__(f"out of memory: {size} bytes asked with {reserved} reserved ({allocated} allocated) "
                         f"of a {capacity}-byte capacity")


@dataclass(frozen=True)
class AllocatorConfig:
    """The allocator's settings (``PYTORCH_CUDA_ALLOC_CONF``) and the memory it may reserve.

    ``capacity``: bytes the allocator may reserve in all (None: unbounded); ``max_split_size``: bytes
    (None: torch's default, no limit); ``roundup_power2_divisions``: one number of divisions for all sizes
    (0 or 1: plain 512-byte rounding)."""

    expandable_segments: bool = False
    max_split_size: int | None = None
    roundup_power2_divisions: int = 0
    capacity: int | None = None

    def __post_init__(self) -> None:
        if self.max_split_size is not None and self.max_split_size <= LARGE_BUFFER:
            raise ValueError(f"max_split_size={self.max_split_size} bytes: torch needs more than 20 MiB "
                             "(max_split_size_mb > 20)")
        d = self.roundup_power2_divisions
        if d < 0 or (d > 1 and d & (d - 1)):
            raise ValueError(f"roundup_power2_divisions={d}: use 0 (off) or a power of two like 4")
        if self.capacity is not None and self.capacity <= 0:
            raise ValueError(f"capacity={self.capacity}: give the bytes the allocator may reserve (> 0), or None")

    @classmethod
    def parse(cls, text: str, capacity: int | None = None) -> "AllocatorConfig":
        """From a ``PYTORCH_CUDA_ALLOC_CONF`` string such as ``"expandable_segments:True,max_split_size_mb:128"``;
        options this model does not use (``garbage_collection_threshold``...) are refused with a one-line error."""
        kw: dict[str, Any] = {}
        for part in (p.strip() for p in text.split(",") if p.strip()):
            key, sep, value = part.partition(":")
            key, value = key.strip(), value.strip()
            try:
                if not sep:
                    raise ValueError
                if key == "expandable_segments":
                    if value not in ("True", "False"):
                        raise ValueError
                    kw["expandable_segments"] = value == "True"
                elif key == "max_split_size_mb":
                    kw["max_split_size"] = int(value) * MiB
                elif key == "roundup_power2_divisions":
                    kw["roundup_power2_divisions"] = int(value)
                else:
                    raise KeyError(key)
            except KeyError:
                raise ValueError(f"allocator setting {key!r} is not modelled; use expandable_segments, "
                                 "max_split_size_mb or roundup_power2_divisions") from None
            except ValueError:
                raise ValueError(f"allocator setting {part!r}: write it as expandable_segments:True, "
                                 "max_split_size_mb:128 or roundup_power2_divisions:4") from None
        return cls(capacity=capacity, **kw)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def round_size(size: int, divisions: int = 0) -> int:
    """A request as the allocator rounds it: at least 512 bytes, a multiple of 512, or with ``divisions``
    (roundup_power2_divisions) up to the next of that many equal steps between two powers of two."""
    if size < MIN_BLOCK:
        return MIN_BLOCK
    if divisions > 1 and size > MIN_BLOCK * divisions:
        if size & (size - 1) == 0:
            return size
        floor = 1 << (size.bit_length() - 1)
        step = floor // divisions
        return size if size % step == 0 else (size // step + 1) * step
    return -(-size // MIN_BLOCK) * MIN_BLOCK


def allocation_size(size: int) -> int:
    """The segment a new (rounded) request of ``size`` bytes makes without expandable segments."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class _Pool:
    __slots__ = ("small", "stream", "free", "unmapped", "page")

    def __init__(self, small: bool, stream: int):
        self.small, self.stream = small, stream
        self.free: list[tuple] = []      # (size, addr, block), sorted: best fit is a bisect
        self.unmapped: list[tuple] = []  # (addr, block) of expandable address space not backed by pages
        self.page = SMALL_BUFFER if small else LARGE_BUFFER


class _Block:
    __slots__ = ("addr", "size", "pool", "base", "prev", "next", "allocated", "mapped", "expandable")

    def __init__(self, addr: int, size: int, pool: _Pool, base: int, expandable: bool = False):
        self.addr, self.size, self.pool, self.base = addr, size, pool, base
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.allocated = False
        self.mapped = True
        self.expandable = expandable


class CachingAllocator:
    """The allocator's state: pools of cached blocks, segments, and torch's counters.

    ``allocated`` is what ``memory_allocated()`` reports (the sizes of blocks in use, an unsplit remainder
    included), ``reserved`` what ``memory_reserved()`` does; ``peak_*`` their maxima, ``segments`` the
    segments held (an expandable segment counts once), ``num_ooms`` the requests refused."""

    def __init__(self, config: AllocatorConfig | None = None):
        self.config = config or AllocatorConfig()
        self._max_split = self.config.max_split_size or _NO_LIMIT
        self._pools: dict[tuple[bool, int], _Pool] = {}
        self._next_addr = 1 << 40
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.segments = self.peak_segments = self.num_ooms = 0

    # -- the two calls ----------------------------------------------------------------------------
    def malloc(self, nbytes: int, stream: int = 0) -> _Block:
        """A block for ``nbytes`` on ``stream``; raises :class:`OutOfMemory` beyond the capacity."""
        size = round_size(int(nbytes), self.config.roundup_power2_divisions)
        small = size <= SMALL_SIZE
        pool = self._pools.get((small, stream))
        if pool is None:
            pool = self._pools[(small, stream)] = _Pool(small, stream)
        block = self._free_block(pool, size)
        if block is None:
            block = (self._new_block(pool, size)
                     or (self._release_oversize(pool, size) and self._new_block(pool, size))
                     or (self._release_cached() and self._new_block(pool, size)))
            if block is None:
                self.num_ooms += 1
                raise OutOfMemory(size, self.reserved, self.allocated, self.config.capacity or 0)
        return self._hand_out(block, size)

    def free(self, block: _Block) -> None:
        """Return ``block`` to its pool, merged with the free neighbours of its segment."""
        block.allocated = False
        self.allocated -= block.size
        for other in (block.prev, block.next):
            if other is not None and not other.allocated and other.mapped:
                self._unlist(other)
                self._merge(block, other)
        self._list(block)

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: return every cached segment (page) with nothing in use."""
        self._release_cached()

    @property
    def unused(self) -> int:
        """Reserved bytes in no block in use: the cached free blocks (an unsplit remainder of a block in use
        counts as allocated, as torch counts it)."""
        return self.reserved - self.allocated

    # -- finding a block ----------------------------------------------------------------------------
    def _free_block(self, pool: _Pool, size: int) -> _Block | None:
        free = pool.free
        i = bisect.bisect_left(free, (size, -1))
        if i == len(free):
            return None
        if self.config.expandable_segments:
            # torch ranks the block at a segment's mapped end by what it could grow to, so a block
            # elsewhere of the same or a slightly larger size goes first
            def grows(b: _Block) -> int:
                return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)
            while i + 1 < len(free) and grows(free[i + 1][2]) < grows(free[i][2]):
                i += 1
        block = free[i][2]
        if size < self._max_split <= block.size:
            return None  # an oversize block serves only oversize requests
        if size >= self._max_split and block.size >= size + LARGE_BUFFER:
            return None
        del free[i]
        return block

    def _hand_out(self, block: _Block, size: int) -> _Block:
        remaining = block.size - size
        if block.pool.small or self.config.expandable_segments:
            split = remaining >= MIN_BLOCK
        else:
            split = size < self._max_split and remaining > SMALL_SIZE
        if split:
            rest = _Block(block.addr + size, remaining, block.pool, block.base, block.expandable)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            self._list(rest)
        block.allocated = True
        self.allocated += block.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return block

    # -- segments -------------------------------------------------------------------------------------
    def _fits(self, nbytes: int) -> bool:
        cap = self.config.capacity
        return cap is None or self.reserved + nbytes <= cap

    def _reserve(self, nbytes: int, segments: int = 0) -> None:
        self.reserved += nbytes
        self.segments += segments
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.peak_segments = max(self.peak_segments, self.segments)

    def _new_block(self, pool: _Pool, size: int) -> _Block | None:
        if self.config.expandable_segments:
            return self._grow(pool, size)
        seg = allocation_size(size)
        if not self._fits(seg):
            return None
        addr = self._next_addr
        self._next_addr += -(-seg // ROUND_LARGE) * ROUND_LARGE
        self._reserve(seg, 1)
        return _Block(addr, seg, pool, addr)

    def _release_oversize(self, pool: _Pool, size: int) -> bool:
        """Free cached oversize segments of ``pool``: one that alone is large enough, else the largest
        until enough is freed (only with max_split_size set)."""
        if self._max_split == _NO_LIMIT:
            return False
        key = max(size, self._max_split)
        free = pool.free
        i = bisect.bisect_left(free, (key, -1))
        if i < len(free):
            self._release(free[i][2])
            return True
        freed = 0
        while free and freed < key and free[-1][0] >= self._max_split:
            freed += free[-1][0]
            self._release(free[-1][2])
        return freed >= key

    def _release_cached(self) -> bool:
        for pool in list(self._pools.values()):
            for _, _, block in list(pool.free):
                if block.expandable:
                    self._unmap(block)
                elif block.prev is None and block.next is None:
                    self._release(block)
        return True

    def _release(self, block: _Block) -> None:
        self._unlist(block)
        self.reserved -= block.size
        self.segments -= 1

    # -- expandable segments ----------------------------------------------------------------------
    def _grow(self, pool: _Pool, size: int) -> _Block | None:
        """Map pages of ``pool``'s expandable segment at the lowest address with room for ``size``."""
        block = self._expandable_room(pool, size)
        if not block.mapped and not self._map(block, min(block.size, size)):
            return None
        while block.size < size:  # free mapped space, then unmapped: map more; _map merges it into ``nxt``
            nxt = block.next
            if not self._map(nxt, min(size - block.size, nxt.size)):
                return None
            block = nxt
        self._unlist(block)
        return block

    def _expandable_room(self, pool: _Pool, size: int) -> _Block:
        def usable(b: _Block | None) -> bool:
            return b is not None and not b.allocated

        for _, c in pool.unmapped:
            if usable(c.prev):
                c = c.prev
            room, b = 0, c
            while room < size and usable(b):
                room += b.size
                b = b.next
            if room >= size:
                return c
        # a new segment: address space for the whole device (here: far more than any capacity), unmapped
        span = 1 << 46
        addr = self._next_addr
        self._next_addr += span
        block = _Block(addr, span, pool, addr, expandable=True)
        block.mapped = False
        bisect.insort(pool.unmapped, (addr, block))
        self.segments += 1
        self.peak_segments = max(self.peak_segments, self.segments)
        return block

    def _map(self, block: _Block, size: int) -> bool:
        """Back ``[block.addr, block.addr + size)`` with whole pages; the block becomes a free mapped block
        (merged with free mapped neighbours: ``block`` is then the merged one)."""
        pool, page = block.pool, block.pool.page
        begin = (block.addr - block.base) // page
        end = -(-(block.addr + size - block.base) // page)
        mapped = (end - begin) * page
        if not self._fits(mapped):
            return False
        self._drop_unmapped(block)
        block.mapped = True
        if mapped < block.size:
            rest = _Block(block.addr + mapped, block.size - mapped, pool, block.base, expandable=True)
            rest.mapped = False
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = mapped
            bisect.insort(pool.unmapped, (rest.addr, rest))
        for other in (block.prev, block.next):
            if other is not None and not other.allocated and other.mapped:
                self._unlist(other)
                self._merge(block, other)
        self._list(block)
        self._reserve(mapped)
        return True

    def _unmap(self, block: _Block) -> None:
        """Return the whole free pages inside free ``block`` to CUDA (torch's unmap_block)."""
        page = block.pool.page
        begin = -(-(block.addr - block.base) // page)
        end = (block.addr + block.size - block.base) // page
        if begin >= end:
            return
        self._unlist(block)
        lo, hi = block.base + begin * page, block.base + end * page
        pool = block.pool
        if lo > block.addr:
            before = _Block(block.addr, lo - block.addr, pool, block.base, expandable=True)
            before.prev, before.next = block.prev, block
            if block.prev is not None:
                block.prev.next = before
            block.prev = before
            self._list(before)
        if hi < block.addr + block.size:
            after = _Block(hi, block.addr + block.size - hi, pool, block.base, expandable=True)
            after.prev, after.next = block, block.next
            if block.next is not None:
                block.next.prev = after
            block.next = after
            self._list(after)
        block.addr, block.size, block.mapped = lo, hi - lo, False
        self.reserved -= block.size
        for other in (block.prev, block.next):
            if other is not None and not other.allocated and not other.mapped:
                self._drop_unmapped(other)
                self._merge(block, other)
        if block.prev is None and block.next is None:  # the whole segment is unmapped: release it
            self.segments -= 1
            return
        bisect.insort(pool.unmapped, (block.addr, block))

    # -- lists --------------------------------------------------------------------------------------
    @staticmethod
    def _merge(dst: _Block, src: _Block) -> None:
        if src is dst.prev:
            dst.addr = src.addr
            dst.prev = src.prev
            if src.prev is not None:
                src.prev.next = dst
        else:
            dst.next = src.next
            if src.next is not None:
                src.next.prev = dst
        dst.size += src.size

    @staticmethod
    def _list(block: _Block) -> None:
        bisect.insort(block.pool.free, (block.size, block.addr, block))

    @staticmethod
    def _unlist(block: _Block) -> None:
        free = block.pool.free
        i = bisect.bisect_left(free, (block.size, block.addr))
        if i < len(free) and free[i][2] is block:
            del free[i]

    @staticmethod
    def _drop_unmapped(block: _Block) -> None:
        un = block.pool.unmapped
        i = bisect.bisect_left(un, (block.addr,))
        if i < len(un) and un[i][1] is block:
            del un[i]


# ==================================================================================================
# Replaying a sequence of allocations and frees
# ==================================================================================================

FLAG_OVERHEAD = 0.05  # a step whose reserved peak exceeds its allocated peak by more than this is flagged


@dataclass(eq=False)
class AllocatorReplay:
    """What the allocator did over a sequence of events: per event, bytes ``reserved`` and ``allocated``
    after it (torch's ``memory_reserved()`` / ``memory_allocated()``), and the figures people ask for.

    - ``peak_reserved`` / ``peak_allocated``: ``max_memory_reserved()`` / ``max_memory_allocated()``;
    - ``fragmentation``: the share of the reserved peak that the allocated peak leaves unused,
      ``(peak_reserved - peak_allocated) / peak_reserved`` (not the share unused at the moment reserved
      peaks: reserved never shrinks without memory pressure, so it often reaches its peak with one more
      2 MiB segment while little is allocated, and that moment says nothing of the cost);
    - ``overhead``: ``peak_reserved / peak_allocated - 1``, what the caching costs beyond the tensors;
    - ``peak_index``: the first event at the reserved peak;
    - ``segments``: segments held at the end, ``peak_segments`` the most at once;
    - ``oom_index``: the first event that asked for more than ``config.capacity`` allows (after freeing
      the cache), else None. The replay goes on past it as if the capacity were unbounded, so the peaks
      say what the sequence needs.
    """

    config: AllocatorConfig
    reserved: np.ndarray
    allocated: np.ndarray
    peak_reserved: int
    peak_allocated: int
    peak_index: int
    segments: int
    peak_segments: int
    base_bytes: int = 0
    oom_index: int | None = None
    oom_bytes: int | None = None
    orphan_frees: int = 0
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def fragmentation(self) -> float:
        return (self.peak_reserved - self.peak_allocated) / self.peak_reserved if self.peak_reserved else 0.0

    @property
    def overhead(self) -> float:
        return self.peak_reserved / self.peak_allocated - 1.0 if self.peak_allocated else 0.0

    @property
    def oom(self) -> bool:
        return self.oom_index is not None

    def by_step(self, steps: np.ndarray) -> list[dict[str, Any]]:
        """Per step (``steps[i]`` is event i's step; -1 outside steps is left out): the reserved and allocated
        peaks within it, the overhead and whether it is over :data:`FLAG_OVERHEAD`."""
        steps = np.asarray(steps)
        out = []
        for s in np.unique(steps[steps >= 0]).tolist():
            rows = steps == s
            res, al = int(self.reserved[rows].max()), int(self.allocated[rows].max())
            over = res / al - 1.0 if al else 0.0
            out.append({"step": int(s), "peak_reserved": res, "peak_allocated": al, "overhead": round(over, 5),
                        "flagged": bool(over > FLAG_OVERHEAD)})
        return out

    def summary(self) -> dict[str, Any]:
        """The figures as plain JSON values."""
        return {"peak_reserved": int(self.peak_reserved), "peak_allocated": int(self.peak_allocated),
                "fragmentation": round(self.fragmentation, 5), "overhead": round(self.overhead, 5),
                "segments": int(self.segments), "peak_segments": int(self.peak_segments),
                "oom": self.oom, "oom_index": self.oom_index, "oom_bytes": self.oom_bytes,
                "base_bytes": int(self.base_bytes), "orphan_frees": int(self.orphan_frees), **self.extra}

    def __repr__(self) -> str:
        from workbench.units import format_bytes

        oom = f", OOM at event {self.oom_index}" if self.oom else ""
        return (f"AllocatorReplay(reserved peak {format_bytes(self.peak_reserved)}, allocated peak "
                f"{format_bytes(self.peak_allocated)}, fragmentation {self.fragmentation:.1%}, "
                f"{self.segments} segment(s){oom})")


def replay(ids: Sequence[int] | np.ndarray, deltas: Sequence[int] | np.ndarray, config: AllocatorConfig | None = None,
           *, base_bytes: int = 0, streams: Sequence[int] | np.ndarray | None = None) -> AllocatorReplay:
    """Replay events through the allocator model: event i changes allocation ``ids[i]`` by ``deltas[i]``
    bytes, as a :class:`~workbench.memory.timeline.MemoryTimeline`'s ``id`` and ``delta_bytes`` do.

    A positive delta for an id not alive allocates it; a delta that leaves an id at 0 frees it; any other
    (a storage resized in place) allocates the new size and then frees the old block, as ``resize_`` does.
    A negative delta for an id never allocated (made before the sequence began) is counted in
    ``orphan_frees`` and otherwise ignored. ``base_bytes`` (alive before the first event, sizes unknown)
    are counted as reserved and allocated without waste. ``streams`` puts each allocation on a stream
    (default: all on one)."""
    import time

    t0 = time.perf_counter()
    config = config or AllocatorConfig()
    ids = np.asarray(ids, dtype=np.int64)
    deltas = np.asarray(deltas, dtype=np.int64)
    if ids.shape != deltas.shape or ids.ndim != 1:
        raise ValueError(f"ids and deltas must be two 1-d sequences of one length (got {ids.shape} and "
                         f"{deltas.shape})")
    stream_list = [0] * len(ids) if streams is None else np.asarray(streams, dtype=np.int64).tolist()
    if len(stream_list) != len(ids):
        raise ValueError(f"streams has {len(stream_list)} entries for {len(ids)} events; give one per event")
    base = int(base_bytes)
    capacity = config.capacity
    alloc = CachingAllocator(config)
    if capacity is not None:
        capacity -= base  # the base is already in the device's memory
        if capacity <= 0:
            return _replay_result(config, alloc, [0] * len(ids), [0] * len(ids), base, 0 if len(ids) else None,
                                  0, 0, t0)
        alloc.config = AllocatorConfig(config.expandable_segments, config.max_split_size,
                                       config.roundup_power2_divisions, capacity)
    live: dict[int, tuple[_Block, int]] = {}
    reserved: list[int] = []
    allocated: list[int] = []
    oom_index = oom_bytes = None
    orphans = 0
    malloc, free = alloc.malloc, alloc.free
    for i, (k, d, st) in enumerate(zip(ids.tolist(), deltas.tolist(), stream_list)):
        if d:
            cur = live.get(k)
            new = d if cur is None else cur[1] + d
            if cur is None and d < 0:
                orphans += 1
            elif new > 0:
                try:
                    block = malloc(new, st)
                except OutOfMemory as e:
                    if oom_index is None:
                        oom_index, oom_bytes = i, e.size
                    alloc.config = AllocatorConfig(config.expandable_segments, config.max_split_size,
                                                   config.roundup_power2_divisions, None)
                    block = malloc(new, st)
                if cur is not None:
                    free(cur[0])
                live[k] = (block, new)
            else:
                free(cur[0])
                del live[k]
        reserved.append(alloc.reserved)
        allocated.append(alloc.allocated)
    return _replay_result(config, alloc, reserved, allocated, base, oom_index, oom_bytes, orphans, t0)


def _replay_result(config: AllocatorConfig, alloc: CachingAllocator, reserved: list[int], allocated: list[int],
                   base: int, oom_index: int | None, oom_bytes: int | None, orphans: int, t0: float) -> AllocatorReplay:
    import time

    res = np.asarray(reserved, dtype=np.int64) + base
    al = np.asarray(allocated, dtype=np.int64) + base
    peak_index = int(np.argmax(res)) if len(res) else -1
    return AllocatorReplay(config, res, al, alloc.peak_reserved + base, alloc.peak_allocated + base, peak_index,
                           alloc.segments, alloc.peak_segments, base, oom_index, oom_bytes, orphans,
                           round(time.perf_counter() - t0, 4))


def replay_timeline(timeline: Any, config: AllocatorConfig | None = None, *,
                    ranks: Iterable[int] | None = None) -> dict[int, AllocatorReplay]:
    """Each rank of a :class:`~workbench.memory.timeline.MemoryTimeline` replayed (its events in order, its
    ``base_bytes`` as already reserved): rank -> :class:`AllocatorReplay`."""
    frame = timeline.frame
    out = {}
    for r in (timeline.ranks if ranks is None else ranks):
        ev = frame[frame["rank"] == r]
        out[int(r)] = replay(ev["id"].to_numpy(), ev["delta_bytes"].to_numpy(), config,
                             base_bytes=timeline.base_bytes.get(r, 0))
    return out
