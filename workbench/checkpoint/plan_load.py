"""``plan_load(src, to=layout)``: will this checkpoint load into that layout? A dry run, no tensor read.

DCP stores every tensor under a layout-free key with its *global* shape, and each rank's shards as
blocks ``[offset, offset + length)`` of it. Loading into another layout reads, for each block the new
rank owns, the overlapping stored blocks::

    saved (dp_shard=2):  [ rank0: rows 0..63 | rank1: rows 64..127 ]
    load  (tp=4):        [ r0 | r1 | r2 | r3 ]   r1 reads rows 32..63 from __0_0.distcp

So the question reduces to names and global shapes: the target model is built on the meta device (no
memory), its state-dict keys (plus AdamW's ``exp_avg``/``exp_avg_sq``/``step`` per parameter when
``full_state``) are compared with the checkpoint's metadata, and the layout is validated against the
model config (:func:`workbench.config.validate`). Same keys + same global shapes + a valid layout =
loadable.
"""

from __future__ import annotations

import dataclasses
import html
import json
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from workbench.checkpoint.contents import inspect
from workbench.checkpoint.manifest import CheckpointManifest, is_hyperparameter
from workbench.config import ModelConfig, ParallelConfig, resolve_model, validate
from workbench.settings import parse_layout, split_settings
from workbench.units import format_bytes

__all__ = ["plan_load", "LoadPlan", "parse_layout"]

_RNG = re.compile(r"^rng\.rank(\d+)\.")


@dataclass
class LoadPlan:
    """The verdict of :func:`plan_load`: ``loadable`` and every reason it is not."""

    src: str
    model: str
    target: dict[str, Any]
    target_description: str
    world_size: int | None
    source_layout: str | None
    source_world_size: int | None
    layout_error: str | None = None
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    reshaped: list[dict[str, Any]] = field(default_factory=list)
    dtype_changes: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checked: int = 0
    bytes_to_read: int = 0

    @property
    def loadable(self) -> bool:
        return self.layout_error is None and not self.missing and not self.reshaped

    def reasons(self) -> list[str]:
        """One line per reason the load would fail (empty when loadable)."""
        out = [f"layout: {self.layout_error}"] if self.layout_error else []
        if self.missing:
            out.append(f"{len(self.missing)} key(s) the target needs are not in the checkpoint (first: {self.missing[0]})")
        for r in self.reshaped[:3]:
            out.append(f"{r['key']}: checkpoint {r['checkpoint_shape']} vs target {r['target_shape']}")
        if len(self.reshaped) > 3:
            out.append(f"... and {len(self.reshaped) - 3} more reshaped key(s)")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "loadable": self.loadable, "reasons": self.reasons()}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    def _repr_html_(self) -> str:
        colour, verdict = ("#1a7f37", "loadable") if self.loadable else ("#cf222e", "NOT loadable")
        items = "".join(f"<li>{html.escape(r)}</li>" for r in self.reasons())
        notes = "".join(f"<li>{html.escape(n)}</li>" for n in self.notes)
        extra = (f"<details><summary>{len(self.unexpected)} checkpoint key(s) the target does not use</summary><pre>"
                 + html.escape("\n".join(self.unexpected[:200])) + "</pre></details>") if self.unexpected else ""
        return (f"<div><b style='color:{colour}'>{verdict}</b>: <code>{html.escape(self.src)}</code> "
                f"({html.escape(self.source_layout or '?')}) &rarr; {html.escape(self.model)} on "
                f"<b>{html.escape(self.target_description)}</b> ({self.world_size} ranks)<br>"
                f"<small>{self.checked} keys checked, {format_bytes(self.bytes_to_read)} to read</small>"
                + (f"<ul>{items}</ul>" if items else "") + (f"<ul>{notes}</ul>" if notes else "") + extra + "</div>")

    def __repr__(self) -> str:
        head = (f"LoadPlan({self.src!r} -> {self.target_description}, loadable={self.loadable}, "
                f"checked={self.checked})")
        return "\n".join([head] + [f"  {r}" for r in self.reasons()] + [f"  note: {n}" for n in self.notes])


def _target_keys(cfg: ModelConfig, full_state: bool, dtype: torch.dtype) -> dict[str, tuple[tuple, str]]:
    from workbench.config import TrainConfig
    from workbench.parallel.build import build_stages

    # The trainer's build on the meta device (shapes only, nothing allocated). Checkpoint keys and
    # global shapes do not depend on the layout, so the one-process build names them all.
    model = build_stages(cfg, ParallelConfig(dp_shard=1), TrainConfig(), None, "meta").model
    keys: dict[str, tuple[tuple, str]] = {}
    for fqn, t in model.state_dict().items():
        keys[f"model.{fqn}"] = (tuple(t.shape), str(dtype).removeprefix("torch."))
    if full_state:  # AdamW state per parameter, in the parameter's dtype (fp32 masters under bf16 compute)
        for fqn, p in model.named_parameters():
            keys[f"optim.state.{fqn}.exp_avg"] = (tuple(p.shape), str(dtype).removeprefix("torch."))
            keys[f"optim.state.{fqn}.exp_avg_sq"] = (tuple(p.shape), str(dtype).removeprefix("torch."))
            keys[f"optim.state.{fqn}.step"] = ((), "float32")
    return keys


def _dequantized_rows(m: CheckpointManifest, rows: dict[str, dict], want: dict[str, tuple[tuple, str]]) -> int:
    """Put each quantized moment (``<key>.q`` codes + ``<key>.qscale`` scales, :mod:`workbench.checkpoint.quant`)
    in ``rows`` under ``<key>``, as a load dequantizes it: the codes' global shape, the target's dtype, the
    bytes of both. Returns how many."""
    from workbench.checkpoint.quant import SCALE, Q

    n = 0
    for key in (m.quant or {}).get("keys") or {}:
        q, scale = rows.get(key + Q), rows.get(key + SCALE)
        if q is None or scale is None or key in rows:
            continue  # verify names a manifest that disagrees with the metadata
        dtype = want[key][1] if key in want else "float32"
        rows[key] = {**q, "key": key, "dtype": dtype, "bytes": int(q["bytes"]) + int(scale["bytes"])}
        del rows[key + Q], rows[key + SCALE]
        n += 1
    return n


def _checked_dtype(dtype: Any) -> str:
    from workbench.config import TrainConfig
    from workbench.schema import check_value, kind_of, settings_of

    ((f, s),) = settings_of(TrainConfig, only=["dtype"])
    return check_value("dtype", dtype, *kind_of(f), s)


def plan_load(src, to: "ParallelConfig | dict | str | None" = None, model: "str | ModelConfig | None" = None,
              *, nproc: int | None = None, full_state: bool = True, dtype: str | None = None,
              **layout: Any) -> LoadPlan:
    """Dry run: would ``src`` load into ``model`` parallelized as ``to``? Reads metadata only.

    ``to``: a ParallelConfig, a dict of its fields, or text like ``"dp_shard=2,tp=2"`` (default: the
    checkpoint's own layout); ``layout`` shortcuts (``tp=2``) apply over it. ``model``: a preset, config
    path or ModelConfig (default: the checkpoint's job config). ``full_state``: also require the
    optimizer state (a resume); False = weights only.
    """
    m = src if isinstance(src, CheckpointManifest) else inspect(src)
    job = m.info.get("job") or {}
    if model is None:
        from workbench.checkpoint.formats import model_config_of

        cfg = model_config_of(m)
        if cfg is None:
            raise ValueError(f"{m.path} does not record its model config; pass model= (a preset like 'tiny' or a "
                             "config.json)")
    else:
        cfg = resolve_model(model)
    if to is None:
        to = m.layout or {"dp_shard": 1}
    if isinstance(to, str):
        to = parse_layout(to)
    elif isinstance(to, dict):
        to = ParallelConfig.from_dict(to)
    if layout:
        to = dataclasses.replace(to, **split_settings(layout, ("parallel",), what="layout setting")["parallel"])
    layout_error = None
    try:
        to = to.resolved(nproc)
        validate(cfg, to)
    except ValueError as e:
        layout_error = str(e)
    # Checked as TrainConfig.dtype is (a query string or a checkpoint's job record may name anything, and
    # getattr(torch, name) would hand back torch.nn for "nn")
    if dtype is None and (job.get("train") or {}).get("dtype"):
        try:  # the checkpoint's own record: a damaged one is named as that, with its file
            dtype = _checked_dtype(job["train"]["dtype"])
        except ValueError as e:
            from workbench.checkpoint.safeload import CheckpointFormatError

            raise CheckpointFormatError(m.path / "workbench.json", f"its job.train.{e}",
                                        "the checkpoint's manifest is damaged; pass dtype= to plan the load") from None
    dtype = _checked_dtype(dtype or "float32")
    want = _target_keys(cfg, full_state, getattr(torch, dtype))
    from workbench.checkpoint.formats import open_source

    rows = {r["key"]: r for r in open_source(m).canonical_rows()}  # canonical names, whatever the format
    quantized = _dequantized_rows(m, rows, want)
    have_non_tensor = set(m.frame.loc[m.frame["shape"].isna(), "key"]) if len(m.frame) else set()
    plan = LoadPlan(src=str(m.path), model=cfg.name, target=to.to_dict(),
                    target_description=to.describe() if to.dp_shard != -1 else str(to),
                    world_size=to.world_size if to.dp_shard != -1 else None,
                    source_layout=m.summary()["layout_description"] or m.format, source_world_size=m.world_size,
                    layout_error=layout_error)
    if m.format not in ("dcp", "workbench"):
        plan.notes.append(f"{m.format} checkpoints load on one process; convert to DCP (`workbench ckpt convert "
                          "--to dcp`) to reshard it onto ranks")
    for key, (shape, dt) in want.items():
        r = rows.get(key)
        if r is None:
            if key not in have_non_tensor:
                plan.missing.append(key)
            continue
        plan.checked += 1
        plan.bytes_to_read += int(r["bytes"])
        if tuple(r["shape"]) != shape:
            if key.endswith(".step") and r["shape"] in ((), (1,)):
                continue
            plan.reshaped.append({"key": key, "checkpoint_shape": list(r["shape"]), "target_shape": list(shape)})
        elif r["dtype"] != dt and not key.endswith(".step"):
            plan.dtype_changes.append({"key": key, "checkpoint_dtype": r["dtype"], "target_dtype": dt})
    for key in rows:  # keys the target does not ask for: harmless for DCP, but worth a look
        # The run's own state beside the tensors: RNG, scheduler, counters, EMA, and the optimizer's
        # hyper-parameters, whatever their storage (optim.hyper.<digest> JSON, or per-key entries), which a
        # resume loads into the param groups. Expected, so never "unexpected".
        if key in want or key.startswith(("rng.", "sched.", "extra.", "ema.")) or is_hyperparameter(key):
            continue
        if key.startswith("optim.") and not full_state:
            continue
        plan.unexpected.append(key)
    if quantized:
        plan.notes.append(f"{quantized} optimizer moment(s) stored quantized ({m.quant.get('mode')}): the load "
                          "dequantizes them into the optimizer's fp32 state")
    if plan.dtype_changes:
        plan.notes.append(f"{len(plan.dtype_changes)} tensor(s) change dtype on load (DCP copies into the "
                          f"target's dtype), e.g. {plan.dtype_changes[0]['key']}: {plan.dtype_changes[0]['checkpoint_dtype']}"
                          f" -> {plan.dtype_changes[0]['target_dtype']}")
    src_ranks = sorted({int(mm.group(1)) for k in rows if (mm := _RNG.match(k))})
    if src_ranks and plan.world_size and plan.world_size != len(src_ranks):
        plan.notes.append(f"the checkpoint holds RNG states of {len(src_ranks)} rank(s) and the target has "
                          f"{plan.world_size}: ranks without a saved state start from the seed")
    if m.world_size and plan.world_size and m.world_size != plan.world_size and plan.loadable:
        plan.notes.append(f"resharding {m.world_size} -> {plan.world_size} ranks: DCP reads each new shard from the "
                          "overlapping saved blocks")
    return plan
