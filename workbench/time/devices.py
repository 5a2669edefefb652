"""Device profiles: how fast a device computes and how fast its links move bytes, the one cost model the
step-time predictor (``workbench.prediction.step_time``) prices operators and collectives with.

A profile is a small JSON file::

    {"format": "workbench.device_profile", "version": 1, "name": "H100-SXM", "kind": "cuda",
     "calibrated": false, "source": "NVIDIA H100 Tensor Core GPU data sheet (SXM5), dense figures",
     "matmul_flops": {"bf16": 989e12, "tf32": 494.7e12, "fp32": 66.9e12},
     "elementwise_bytes_per_s": 3.35e12,
     "efficiency": {"matmul": 0.65, "attention": 0.5, "elementwise": 0.8, "collective": 0.8},
     "op_overhead_s": 4e-6, "view_overhead_s": 0.0,
     "links": {"intra": {"latency_s": 3e-6, "bytes_per_s": 450e9, "algorithm": "ring"},
               "inter": {"latency_s": 8e-6, "bytes_per_s": 50e9, "algorithm": "ring"}},
     "gpus_per_node": 8, "memory_bytes": 85899345920, "assumptions": {...}}

Shipped profiles (``workbench/time/profiles/*.json``: H100-SXM, H200, A100-SXM-80GB) hold data-sheet peaks and
say ``"calibrated": false``; their efficiencies are stated assumptions, not measurements. ``workbench time
calibrate`` measures this machine and saves a calibrated profile (``cpu.json`` in the profile directory:
``$WORKBENCH_DEVICE_PROFILE_DIR``, else ``~/.cache/workbench/devices``), which ``device_profile("cpu")`` then
returns; without one it returns a conservative default marked uncalibrated.

The link model, one rank's view of one call over ``n`` ranks with a full (gathered / reduced) buffer of ``N``
bytes on link ``(latency a, bandwidth b, efficiency e)``::

    all_reduce      ring: 2(n-1) a + 2 (n-1)/n N / (b e)      tree: 2 log2(n) a + the same bytes term
    all_gather,
    reduce_scatter  ring: (n-1) a + (n-1)/n N / (b e)         tree: log2(n) a + the same bytes term
    broadcast       as all_gather
    all_to_all      (n-1) a + (n-1)/n N / (b e)               (direct sends: no tree)
    send/recv       a + N / (b e)

``b`` is one direction of one GPU's link (NVLink's 900 GB/s bidirectional is 450 GB/s; a 400 Gb/s InfiniBand
port per GPU is 50 GB/s). A group within one node uses the ``intra`` link, a group spanning nodes the
``inter`` one (its ring crosses the slowest link).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DeviceProfile", "Link", "device_profile", "profile_names", "profile_dir", "FORMAT", "COLLECTIVE_KINDS"]

FORMAT = "workbench.device_profile"
VERSION = 1
MAX_PROFILE_BYTES = 1 << 20  # a profile is a few hundred bytes; anything past 1 MiB is not one
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send/recv")
_SHIPPED = Path(__file__).with_name("profiles")
_OP_CLASSES = ("matmul", "attention", "elementwise", "collective")


@dataclass(frozen=True)
class Link:
    """One kind of link as one rank sees it: per-message latency, one direction's bandwidth, and the
    algorithm collectives over it use (``ring`` or ``tree``)."""

    latency_s: float
    bytes_per_s: float
    algorithm: str = "ring"

    def __post_init__(self) -> None:
        if self.algorithm not in ("ring", "tree"):
            raise ValueError(f"link algorithm {self.algorithm!r}: choose 'ring' or 'tree'")
        if not (self.bytes_per_s > 0 and self.latency_s >= 0):
            raise ValueError(f"a link needs bytes_per_s > 0 and latency_s >= 0 (got {self.bytes_per_s}, "
                             f"{self.latency_s})")


@dataclass(frozen=True)
class DeviceProfile:
    """What one device (GPU, or this machine's CPU per rank) does per second; see the module docstring."""

    name: str
    calibrated: bool
    source: str
    matmul_flops: dict[str, float]            # dtype ("bf16", "fp16", "tf32", "fp32") -> peak flop/s
    elementwise_bytes_per_s: float            # memory bandwidth (HBM, or DRAM per rank)
    efficiency: dict[str, float]              # op class -> fraction of peak reached (matmul, attention, ...)
    op_overhead_s: float                      # per operator that runs a kernel: launch / dispatch
    links: dict[str, Link]                    # "intra" (within a node), "inter" (across nodes)
    gpus_per_node: int = 8
    memory_bytes: int = 0
    kind: str = "cuda"                        # "cuda": host runs ahead of the device; "cpu": it does not
    view_overhead_s: float = 0.0              # per operator that only makes a view (no kernel)
    cores: int = 0                            # CPU: cores the ranks of one host share (0: a device per rank)
    assumptions: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in ("cuda", "cpu"):
            raise ValueError(f"profile kind {self.kind!r}: choose 'cuda' or 'cpu'")
        if not self.matmul_flops or any(not (v > 0) for v in self.matmul_flops.values()):
            raise ValueError("a profile needs matmul_flops with a positive flop/s per dtype")
        if not self.elementwise_bytes_per_s > 0:
            raise ValueError("a profile needs elementwise_bytes_per_s > 0")
        bad = {k: v for k, v in self.efficiency.items() if not 0 < v <= 1}
        if bad:
            raise ValueError(f"efficiencies are fractions in (0, 1]; got {bad}")
        if set(self.links) != {"intra", "inter"}:
            raise ValueError(f"a profile's links are 'intra' and 'inter'; got {sorted(self.links)}")
        if not isinstance(self.cores, int) or isinstance(self.cores, bool) or self.cores < 0:
            raise ValueError(f"cores={self.cores!r}: the cores ranks share, a whole number >= 0 (0: one device per rank)")
        if self.gpus_per_node < 1 or self.op_overhead_s < 0 or self.view_overhead_s < 0:
            raise ValueError("a profile needs gpus_per_node >= 1 and overheads >= 0")

    # -- the cost model -------------------------------------------------------------------------
    def eff(self, op_class: str) -> float:
        return float(self.efficiency.get(op_class, self.efficiency.get("elementwise", 1.0)))

    def flops_per_s(self, dtype: str) -> float:
        """Peak matmul flop/s for ``dtype`` (fp16 falls back to bf16, tf32 to fp32, others to the slowest)."""
        m = self.matmul_flops
        for key in (dtype, {"fp16": "bf16", "bf16": "fp16", "tf32": "fp32"}.get(dtype, "")):
            if key in m:
                return float(m[key])
        return float(min(m.values()))

    def compute_time(self, flops: float, nbytes: float, op_class: str = "elementwise", dtype: str = "fp32") -> float:
        """Seconds of one operator on the roofline: max(flops at the class's efficiency, bytes at memory
        bandwidth), plus the per-operator overhead (a view: ``view_overhead_s``)."""
        if op_class == "view":
            return self.view_overhead_s
        t_flops = flops / (self.flops_per_s(dtype) * self.eff(op_class)) if flops else 0.0
        t_bytes = nbytes / (self.elementwise_bytes_per_s * self.eff("elementwise")) if nbytes else 0.0
        return max(t_flops, t_bytes) + self.op_overhead_s

    def collective_time(self, kind: str, nbytes: float, group_size: int, intra: bool) -> float:
        """Seconds of one collective call on a full buffer of ``nbytes`` over ``group_size`` ranks."""
        if kind not in COLLECTIVE_KINDS:
            raise ValueError(f"collective {kind!r} is unknown; choose one of {list(COLLECTIVE_KINDS)}")
        n = int(group_size)
        link = self.links["intra" if intra else "inter"]
        bw = link.bytes_per_s * self.eff("collective")
        if kind == "send/recv":
            return link.latency_s + nbytes / bw
        if n <= 1:
            return 0.0
        share = (n - 1) / n * nbytes
        hops = n - 1
        if link.algorithm == "tree" and kind != "all_to_all":
            hops = max(1, math.ceil(math.log2(n)))
        if kind == "all_reduce":
            return 2 * hops * link.latency_s + 2 * share / bw
        return hops * link.latency_s + share / bw

    def describe(self) -> dict[str, Any]:
        """What a prediction's meta says of the device model it used."""
        return {"name": self.name, "calibrated": self.calibrated, "source": self.source}

    # -- files ----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["links"] = {k: dataclasses.asdict(v) for k, v in self.links.items()}
        return {"format": FORMAT, "version": VERSION, **d}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, doc: Any, where: str = "a device profile") -> "DeviceProfile":
        """A profile from its JSON document; anything wrong is one ValueError naming ``where`` and the field."""
        fix = "restore it, or save a new one with `workbench time calibrate`"
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"{where} is not a device profile (no 'format': '{FORMAT}'); {fix}")
        if doc.get("version") != VERSION:
            raise ValueError(f"{where} is a device profile of version {doc.get('version')!r}; this workbench reads "
                             f"version {VERSION}")
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in doc.items() if k in names}
        try:
            links = kw.get("links")
            if not isinstance(links, dict):
                raise ValueError("'links' must map 'intra' and 'inter' to links")
            kw["links"] = {k: Link(float(v["latency_s"]), float(v["bytes_per_s"]), str(v.get("algorithm", "ring")))
                           for k, v in links.items()}
            for k in ("matmul_flops", "efficiency"):
                if not isinstance(kw.get(k), dict):
                    raise ValueError(f"{k!r} must map names to numbers")
                kw[k] = {str(a): float(b) for a, b in kw[k].items()}
            for k in ("elementwise_bytes_per_s", "op_overhead_s", "view_overhead_s"):
                if k in kw:
                    kw[k] = float(kw[k])
            for k in ("gpus_per_node", "memory_bytes"):
                if k in kw:
                    kw[k] = int(kw[k])
            kw["calibrated"] = bool(kw.get("calibrated", False))
            kw["assumptions"] = {str(a): str(b) for a, b in (kw.get("assumptions") or {}).items()}
            return cls(**kw)
        except (TypeError, KeyError, ValueError, AttributeError) as e:
            msg = str(e) if isinstance(e, ValueError) else f"a field is missing or of the wrong type ({e!s:.80})"
            raise ValueError(f"{where} is damaged: {msg}; {fix}") from None

    @classmethod
    def from_json(cls, text: str, where: str = "a device profile") -> "DeviceProfile":
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"{where} is not a device profile (not readable JSON: {type(e).__name__}); restore it, "
                             "or save a new one with `workbench time calibrate`") from None
        return cls.from_dict(doc, where)

    def save(self, path: str | os.PathLike | None = None) -> Path:
        """Write the profile (default: ``<profile_dir()>/<name>.json``), replaced atomically."""
        p = Path(path) if path is not None else profile_dir() / f"{self.name}.json"
        if p.suffix != ".json":
            p = p / f"{self.name}.json"
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(self.to_json())
        os.replace(tmp, p)
        return p

    @classmethod
    def load(cls, path: str | os.PathLike) -> "DeviceProfile":
        """Read a profile file (bounded: at most 1 MiB, a regular file); one ValueError naming it otherwise."""
        from workbench.safeio import read_bounded

        data = read_bounded(path, MAX_PROFILE_BYTES, "device profile",
                            fix_missing="name a shipped profile or save one with `workbench time calibrate`")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{path} is not a device profile (not UTF-8 text); restore it, or save a new one with "
                             "`workbench time calibrate`") from None
        return cls.from_json(text, str(path))


def profile_dir() -> Path:
    """Where saved (calibrated) profiles live: ``$WORKBENCH_DEVICE_PROFILE_DIR``, else ``~/.cache/workbench/devices``."""
    env = os.environ.get("WORKBENCH_DEVICE_PROFILE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "workbench" / "devices"


def profile_names() -> list[str]:
    """Names ``device_profile`` accepts: the shipped profiles, saved ones, and ``cpu``."""
    names = {p.stem for p in _SHIPPED.glob("*.json")} | {"cpu"}
    d = profile_dir()
    if d.is_dir():
        names |= {p.stem for p in d.glob("*.json")}
    return sorted(names)


def _cpu_default() -> DeviceProfile:
    """A conservative per-rank CPU profile for when nothing was calibrated here (gloo over loopback)."""
    from workbench.cpu_quota import usable_cpus

    return DeviceProfile(
        name="cpu", calibrated=False, kind="cpu",
        source="workbench default for a CPU rank (not measured; run `workbench time calibrate`)",
        matmul_flops={"fp32": 2.0e10, "bf16": 5.0e9}, elementwise_bytes_per_s=4.0e9,
        efficiency={"matmul": 1.0, "attention": 0.7, "elementwise": 1.0, "collective": 1.0},
        op_overhead_s=1.5e-5, view_overhead_s=5e-6,
        links={"intra": Link(5e-5, 1.0e9), "inter": Link(1e-4, 1.0e9)}, gpus_per_node=1 << 16, memory_bytes=0,
        cores=max(1, int(usable_cpus())),
        assumptions={"all": "guessed figures for one CPU rank on one thread; the ranks share this machine's "
                            "cores; calibrate for real figures"})


def device_profile(name_or_path: "str | os.PathLike | DeviceProfile | None" = None) -> DeviceProfile:
    """A device profile by name (``H100-SXM``, ``H200``, ``A100-SXM-80GB``, ``cpu``, or one saved in
    :func:`profile_dir`) or by path to its JSON file. ``cpu`` is this machine's calibrated profile when
    ``workbench time calibrate`` saved one, else a conservative default marked uncalibrated."""
    if isinstance(name_or_path, DeviceProfile):
        return name_or_path
    if name_or_path is None:
        name_or_path = "cpu"
    text = os.fspath(name_or_path)
    if text.endswith(".json") or os.sep in text:
        return DeviceProfile.load(text)
    saved = profile_dir() / f"{text}.json"
    if saved.exists():
        return DeviceProfile.load(saved)
    shipped = _SHIPPED / f"{text}.json"
    if shipped.exists():
        return DeviceProfile.load(shipped)
    if text == "cpu":
        return _cpu_default()
    lower = {n.lower(): n for n in profile_names()}
    if text.lower() in lower:
        return device_profile(lower[text.lower()])
    raise ValueError(f"unknown device {text!r}; choose one of {profile_names()} or give a profile's .json path")
