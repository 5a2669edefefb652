"""``verify(path)``: is this checkpoint whole? Checksums, sizes, and chunks that tile every tensor.

What is checked, cheapest first (no tensor is loaded unless ``deep=True``):

1. metadata and headers parse (DCP ``.metadata`` with the restricted unpickler; safetensors headers
   against their file sizes; index files against their shards);
2. ``workbench.json``: every listed file exists with the recorded size and checksum (xxh3_128, or
   sha256 in checkpoints saved before it), and no data file is present that the save did not list;
3. DCP storage: every chunk's ``[offset, offset + length)`` lies inside its ``.distcp`` file;
4. completeness: for each tensor of global shape ``S`` the chunks are boxes ``[o, o + l)`` that lie in
   ``S`` and tile it exactly::

        sum_c prod(l_c) == prod(S)   and   no two boxes intersect   =>   no gaps, no overlaps

5. ``deep=True``: every tensor is read (one at a time) and non-finite values are reported as warnings.
"""

from __future__ import annotations

import html
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.progress import tqdm

from workbench.checkpoint.contents import _DISTCP, identify, inspect, read_hf_index
from workbench.checkpoint.manifest import CheckpointManifest, is_hyperparameter
from workbench.checkpoint.safeload import CheckpointFormatError
from workbench.checkpoint.store import new_hash, recorded_digest
from workbench.safeio import FileRefused, confine, open_regular, regular_size

__all__ = ["verify", "VerifyReport", "Problem"]


@dataclass(frozen=True)
class Problem:
    file: str
    problem: str
    fix: str

    def __str__(self) -> str:
        return f"{self.file}: {self.problem}; {self.fix}"


@dataclass
class VerifyReport:
    """``ok`` is True when no problem was found. ``problems`` name the file, the problem and the fix."""

    path: str
    format: str | None
    problems: list[Problem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    checked: dict[str, int] = field(default_factory=dict)
    quant: str | None = None  # what of the optimizer state is stored quantized (one line), if any

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "format": self.format, "ok": self.ok,
                "problems": [vars(p) | {"message": str(p)} for p in self.problems],
                "warnings": self.warnings, "checked": self.checked, "quant": self.quant}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def _repr_html_(self) -> str:
        colour, verdict = ("#1a7f37", "OK") if self.ok else ("#cf222e", f"{len(self.problems)} problem(s)")
        checked = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in self.checked.items())
        items = "".join(f"<li><code>{html.escape(p.file)}</code>: {html.escape(p.problem)}; "
                        f"<i>{html.escape(p.fix)}</i></li>" for p in self.problems)
        warns = "".join(f"<li>{html.escape(w)}</li>" for w in self.warnings)
        return (f"<div><b style='color:{colour}'>verify: {verdict}</b> <code>{html.escape(self.path)}</code> "
                f"({self.format})<br><small>checked: {checked}</small>"
                + (f"<br><small>{html.escape(self.quant)}</small>" if self.quant else "")
                + (f"<ul>{items}</ul>" if items else "") + (f"<b>warnings</b><ul>{warns}</ul>" if warns else "")
                + "</div>")

    def __repr__(self) -> str:
        lines = [f"VerifyReport({self.path!r}, ok={self.ok}, checked={self.checked})"]
        lines += [f"  problem: {p}" for p in self.problems] + [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def _digest(path: Path, algo: str, bar) -> str:
    h = new_hash(algo)
    with open_regular(path, "checkpoint file", error=CheckpointFormatError) as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _check_workbench_files(root: Path, info: dict, report: VerifyReport, progress: bool) -> None:
    listed = info.get("files") or {}
    if not isinstance(listed, dict) or not listed:
        report.problems.append(Problem(str(root / "workbench.json"), "lists no files with sizes and checksums",
                                       "re-save the checkpoint with workbench (checksums are written last)"))
        return
    manifest = root / "workbench.json"
    bad = next((rel for rel, want in listed.items() if not isinstance(want, dict) or type(want.get("bytes")) is not int
                or want["bytes"] < 0), None)
    if bad is not None:
        report.problems.append(Problem(str(manifest), f"its entry for {str(bad)[:200]!r} has no size",
                                       "the manifest is damaged; restore it or use another checkpoint step"))
        return
    total = sum(v["bytes"] for v in listed.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc="checksums", disable=not progress, leave=False) as bar:
        for rel, want in sorted(listed.items()):
            try:  # inside the directory (a listed ../x, /x or link out is a problem, never opened), a regular file
                f = confine(root, rel, manifest, "checkpoint file", error=CheckpointFormatError)
                size = regular_size(f, "checkpoint file", error=CheckpointFormatError) if f.exists() else None
            except FileRefused as e:
                report.problems.append(Problem(e.file, e.problem, e.fix))
                continue
            if size is None:
                report.problems.append(Problem(str(f), "listed in workbench.json but missing",
                                               "restore the file or use another checkpoint step"))
                continue
            if size != want.get("bytes"):
                report.problems.append(Problem(str(f), f"has {size} bytes, workbench.json recorded {want.get('bytes')}",
                                               "the file is truncated or was rewritten; restore it or use another step"))
                bar.update(size)
                continue
            recorded = recorded_digest(want)
            try:
                differs = recorded is not None and _digest(f, recorded[0], bar) != recorded[1]
            except FileRefused as e:  # swapped for a FIFO or removed since it was checked
                report.problems.append(Problem(e.file, e.problem, e.fix))
                continue
            if differs:
                report.problems.append(Problem(str(f), f"{recorded[0]} differs from workbench.json (corrupted bytes)",
                                               "restore the file from a copy or use another checkpoint step"))
    report.checked["files_hashed"] = len(listed)
    report.checked["bytes_hashed"] = total
    for f in root.iterdir():
        if (_DISTCP.match(f.name) or f.name == ".metadata") and f.name not in listed:
            report.problems.append(Problem(str(f), "is not listed in workbench.json (not part of this save)",
                                           "remove it; it is left over from another save"))


def _boxes_intersect(a_off, a_len, b_off, b_len) -> bool:
    return all(ao < bo + bl and bo < ao + al for ao, al, bo, bl in zip(a_off, a_len, b_off, b_len))


_OVERLAP_BUDGET = 20_000_000  # box comparisons per tensor (seconds of Python); a hostile layout stops there


def _first_overlap(shards: list[dict]) -> tuple[dict, dict] | None | str:
    """Two chunks that intersect, None, or "unchecked" past the budget. A sweep along dimension 0: each chunk
    is compared only with the chunks whose dimension-0 range is still open where it starts (its row band),
    not with all others, so n chunks on a (dp x tp) grid cost about n x tp comparisons, not n^2 / 2."""
    order = sorted(shards, key=lambda s: s["offsets"][0] if s["offsets"] else 0)
    open_: list[dict] = []
    budget = _OVERLAP_BUDGET
    for s in order:
        off, ln = s["offsets"], s["lengths"]
        if off:
            open_ = [a for a in open_ if a["offsets"][0] + a["lengths"][0] > off[0]]
        budget -= len(open_) + 1
        if budget < 0:
            return "unchecked"
        hit = next((a for a in open_ if _boxes_intersect(a["offsets"], a["lengths"], off, ln)), None)
        if hit is not None:
            return hit, s
        open_.append(s)
    return None


def _check_dcp_chunks(m: CheckpointManifest, report: VerifyReport, skip_files: set[str] = frozenset()) -> None:
    sizes: dict[str, int | None] = {}
    for rel in m.files:
        try:  # read_dcp_metadata checked the names; a link out of the directory or a FIFO is refused here
            f = confine(m.path, rel, m.path / ".metadata", "data file", error=CheckpointFormatError)
            sizes[rel] = regular_size(f, "DCP data file", error=CheckpointFormatError) if f.exists() else None
        except FileRefused as e:
            sizes[rel] = None
            report.problems.append(Problem(e.file, e.problem, e.fix))
            continue
        if sizes[rel] is None:
            report.problems.append(Problem(str(f), "named by .metadata but missing",
                                           "restore the shard file or use another checkpoint step"))
    n_chunks = 0
    beyond: dict[str, list] = {}  # file -> [chunks past its end, first key, bytes needed]
    for r in m.frame.itertuples(index=False):
        for s in r.shards:
            n_chunks += 1
            if s["file"] is None:
                report.problems.append(Problem(str(m.path / ".metadata"), f"{r.key} chunk at {s['offsets']} has no "
                                               "storage entry", "the metadata is inconsistent; re-save"))
                continue
            size = sizes.get(s["file"])
            end = s["byte_offset"] + s["byte_length"]
            if size is not None and end > size:
                b = beyond.setdefault(s["file"], [0, r.key, 0])
                b[0] += 1
                b[2] = max(b[2], end)
        if r.shape is None:
            continue
        shape = list(r.shape)
        covered = 0
        for s in r.shards:
            off, ln = s["offsets"], s["lengths"]
            if len(off) != len(shape) or any(o < 0 or o + n > d for o, n, d in zip(off, ln, shape)):
                report.problems.append(Problem(str(m.path / ".metadata"), f"{r.key} chunk {off}+{ln} lies outside "
                                               f"the global shape {shape}", "the metadata is inconsistent; re-save"))
            covered += math.prod(ln)
        overlap = _first_overlap(r.shards)
        if overlap == "unchecked":
            report.warnings.append(f"{r.key}: {len(r.shards)} chunks in one band of rows; whether they overlap was "
                                   f"not checked (more than {_OVERLAP_BUDGET:,} comparisons)")
            overlap = None
        if overlap:
            report.problems.append(Problem(str(m.path / ".metadata"), f"{r.key} chunks at {overlap[0]['offsets']} and "
                                           f"{overlap[1]['offsets']} overlap", "the metadata is inconsistent; re-save"))
        elif covered != math.prod(shape):
            report.problems.append(Problem(str(m.path / ".metadata"), f"{r.key} chunks cover {covered} of "
                                           f"{math.prod(shape)} elements of {shape} (gaps)",
                                           "a rank's shards are missing; use a complete checkpoint step"))
    for rel, (n, first, need) in sorted(beyond.items()):
        if rel in skip_files:  # already reported (size differs from workbench.json): one line per bad file
            continue
        report.problems.append(Problem(str(m.path / rel), f"has {sizes[rel]} bytes but .metadata places {n} chunk(s) "
                                       f"up to byte {need} (first: {first}); the file is truncated",
                                       "restore the file or use another checkpoint step"))
    report.checked["chunks"] = n_chunks
    _count(m, report)


def _check_hf_index(m: CheckpointManifest, report: VerifyReport) -> None:
    for index in sorted(m.path.glob("*.safetensors.index.json")):
        doc = read_hf_index(index)
        total = (doc.get("metadata") or {}).get("total_size")
        keys = set(doc["weight_map"])
        actual = int(m.frame.loc[m.frame["key"].isin(keys), "bytes"].sum())
        if total is not None and (type(total) is not int or total != actual):
            report.problems.append(Problem(str(index), f"metadata.total_size={total} but its tensors hold {actual} bytes",
                                           "re-export the checkpoint"))
    _count(m, report)
    report.checked["files"] = len(m.files)


def _count(m: CheckpointManifest, report: VerifyReport) -> None:
    """Tensors as the manifest counts them (``summary()["n_tensors"]``, what inspect and the tab show), and
    the optimizer hyper-parameter entries apart (a packed ``optim.hyper.*`` item is JSON bytes, not a tensor),
    so every tool gives one number for one checkpoint."""
    report.checked["tensors"] = m.n_tensors
    if m.n_hyperparameters:
        report.checked["hyperparameter_entries"] = m.n_hyperparameters


def verify(path: "str | os.PathLike | CheckpointManifest", *, deep: bool = False, progress: bool = True) -> VerifyReport:
    """Check the checkpoint at ``path`` (see the module docstring). Never raises for a bad checkpoint."""
    if isinstance(path, CheckpointManifest):
        path = path.path
    report = VerifyReport(path=str(path), format=None)
    try:
        return _verify(path, report, deep, progress)
    except FileRefused as e:  # CheckpointFormatError too: a file refused anywhere in the checks
        report.problems.append(Problem(e.file, e.problem, e.fix))
    except OSError as e:  # a file removed, or made unreadable, while it was checked
        report.problems.append(Problem(str(getattr(e, "filename", None) or report.path),
                                       f"cannot be read ({e.strerror or type(e).__name__})",
                                       "check that nothing removes or rewrites the checkpoint while it is verified"))
    except Exception as e:  # the promise is a report, whatever the files hold; the type only, never their bytes
        if os.environ.get("WORKBENCH_DEBUG"):
            raise
        report.problems.append(Problem(report.path, f"cannot be checked ({type(e).__name__} while reading it)",
                                       "the checkpoint is damaged in a way verify does not name; restore it or use "
                                       "another step (WORKBENCH_DEBUG=1 shows where)"))
    return report


def _verify(path, report: VerifyReport, deep: bool, progress: bool) -> VerifyReport:
    fmt, root = identify(path)
    report.path, report.format = str(root), fmt
    m = inspect(root)
    if fmt == "workbench":
        _check_workbench_files(root, m.info, report, progress)
        if m.quant:
            _check_quant(root, m, report)
    if fmt in ("workbench", "dcp"):
        reported = {Path(p.file).name for p in report.problems}
        _check_dcp_chunks(m, report, reported)
    elif fmt == "hf":
        _check_hf_index(m, report)
    else:
        _count(m, report)
        report.checked["files"] = len(m.files)
    if deep and report.ok:
        _deep_check(m, report, progress)
    return report


def _check_quant(root: Path, m: CheckpointManifest, report: VerifyReport) -> None:
    """Every moment the manifest calls quantized is stored as ``.q`` + ``.qscale`` of matching shapes."""
    from workbench.checkpoint.quant import SCALE, Q, describe

    report.quant = describe(m.quant)
    shapes = {r.key: tuple(r.shape) for r in m.frame.itertuples(index=False) if r.shape is not None}
    for key, block in m.quant["keys"].items():
        q, scale = shapes.get(key + Q), shapes.get(key + SCALE)
        if q is not None and (type(block) is not int or block <= 0 or not q):
            report.problems.append(Problem(str(root / "workbench.json"), f"{key} is listed as quantized in blocks of "
                                           f"{str(block)[:20]}, not a positive block size of a stored tensor",
                                           "re-save the checkpoint (its manifest is damaged)"))
        elif q is None or scale is None or key in shapes:
            report.problems.append(Problem(str(root / ".metadata"), f"{key} is listed as quantized but stored "
                                           "otherwise", "re-save the checkpoint (its metadata and manifest disagree)"))
        elif scale != (*q[:-1], q[-1] // int(block)):
            report.problems.append(Problem(str(root / ".metadata"), f"{key}{SCALE} is {scale}, not one scale per "
                                           f"block of {block} of {q}", "re-save the checkpoint"))
    report.checked["quantized_moments"] = len(m.quant["keys"])


def _deep_check(m: CheckpointManifest, report: VerifyReport, progress: bool) -> None:
    import torch

    from workbench.checkpoint.formats import iter_tensors

    n = 0
    try:
        for key, t in iter_tensors(m, progress=progress):
            n += not is_hyperparameter(key)  # counted as the manifest counts tensors (see _count)
            # isfinite has no float8 kernels: test in fp32, which holds every float8 value exactly
            finite = torch.isfinite(t.float() if t.itemsize == 1 else t) if t.is_floating_point() else None
            if finite is not None and not bool(finite.all()):
                bad = int((~finite).sum())
                report.warnings.append(f"{key}: {bad} non-finite value(s) of {t.numel()}")
    except CheckpointFormatError as e:
        report.problems.append(Problem(e.file, e.problem, e.fix))
    report.checked["tensors_loaded"] = n
    report.checked["bytes_loaded"] = int(m.tensors()["bytes"].sum()) if report.ok else 0
