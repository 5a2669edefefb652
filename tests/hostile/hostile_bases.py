"""The valid inputs the hostile ones are made from: one of every format a workbench reader takes, each
written by the code that writes it for real (the checkpoint saver, ``export``, torch's profiler, the
snapshot writer in torch's exact format, ``MemoryTimeline.save``, ``ShardingPlan.to_json``, the event
writer), for a model small enough that a copy costs microseconds.
"""

from __future__ import annotations

import gzip
import json
import shutil
import warnings
from pathlib import Path

MICRO = dict(name="micro", dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=32, vocab_size=32, max_seq_len=16)
KEY = "model.output.weight"  # a tensor every checkpoint base holds, by its canonical key

# format -> the base's path under the bases directory (a file or a directory)
BASES = {
    "snapshot": "snapshot/snapshot_rank0.pickle",
    "profiler": "profiler/trace.json",
    "profiler_gz": "profiler_gz/trace.json.gz",
    "timeline": "timeline",
    "dcp": "run/checkpoints/step-000001",
    "dcp_plain": "plain/step-000001",
    "hf": "hf",
    "safetensors": "single/model.safetensors",
    "torch": "pt/model.pt",
    "run": "run",
    "plan": "plan/plan.json",
    "config": "config/config.json",
}


def micro_config():
    from workbench.config import ModelConfig

    return ModelConfig(**MICRO)


def _events(run: Path, step_dir: Path) -> None:
    """A finished 2-step run's events, as the launcher and a rank write them (a pipeline schedule too)."""
    from workbench.train.events import LAUNCHER_RANK, EventWriter

    t = 1_700_000_000.0
    with EventWriter(run, LAUNCHER_RANK) as w:
        w.emit("launch", nproc=1, run_dir=str(run))
    with EventWriter(run, 0) as w:
        w.emit("start", layout={"dp_shard": 1}, device="cpu", backend="gloo")
        w.emit("pipeline", schedule="1F1B", microbatches=2, stages=[0])
        for step in (0, 1):
            w.emit("step", step=step, loss=3.4 - step * 0.1, tokens_per_s=1000.0 + step, step_time_s=0.01,
                   mem_bytes=10_000 + step, grad_norm=1.0, lr=1e-3)
            w.emit("schedule", step=step, actions=[
                {"stage": 0, "microbatch": m, "phase": ph, "start": t + step + m * 0.01 + (ph == "B") * 0.005,
                 "end": t + step + m * 0.01 + (ph == "B") * 0.005 + 0.004} for m in (0, 1) for ph in ("F", "B")])
        w.emit("checkpoint", step=1, path=str(step_dir), bytes=1, blocking_s=0.0, total_s=0.0, status="ok")
        w.emit("end", steps=2)
    with EventWriter(run, LAUNCHER_RANK) as w:
        w.emit("run_end", status="succeeded")


def _profiler_trace(path: Path) -> None:
    import torch

    from workbench.models import build_model

    model = build_model(micro_config(), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    x = torch.randint(0, 32, (1, 4))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        model(x).float().mean().backward()
        opt.step()
    prof.export_chrome_trace(str(path))
    # Keep the trace small (every fuzz input parses it): the memory events and the spans around them.
    doc = json.loads(path.read_text())
    events = doc["traceEvents"]
    memory = [e for e in events if e.get("name") == "[memory]"][:40]
    spans = [e for e in events if e.get("ph") == "X"][:60]
    doc["traceEvents"] = spans + memory
    path.write_text(json.dumps(doc))


def build_bases(d: Path) -> dict[str, Path]:
    """Write every base under ``d``; ``{format: path}``."""
    import torch

    import workbench
    from workbench.checkpoint import TrainState, export, save
    from workbench.config import JobConfig, ParallelConfig, TrainConfig
    from workbench.memory.snapshot import import_snapshots, write_synthetic_snapshot
    from workbench.models import build_model

    cfg = micro_config()
    torch.manual_seed(0)
    model = build_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    model(torch.randint(0, cfg.vocab_size, (2, 8))).float().mean().backward()
    opt.step()
    job = JobConfig(model=cfg, parallel=ParallelConfig(dp_shard=1), train=TrainConfig(steps=2))
    run = d / "run"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(job.to_dict()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = save(run / "checkpoints", TrainState(model, opt, step=1),
                    manifest={"job": job.to_dict(), "layout": job.parallel.to_dict(), "step": 1})
    _events(run, step)
    plain = d / BASES["dcp_plain"]
    shutil.copytree(step, plain)
    (plain / "workbench.json").unlink()
    export(step, d / "hf", to="hf", progress=False)
    (d / "single").mkdir()
    export(step, d / BASES["safetensors"], to="safetensors", progress=False)
    (d / "pt").mkdir()
    export(step, d / BASES["torch"], to="torch", progress=False)
    (d / "config").mkdir()
    shutil.copy(d / "hf" / "config.json", d / BASES["config"])

    (d / "snapshot").mkdir()
    write_synthetic_snapshot(d / BASES["snapshot"], 12_000, seed=1, layers=2)
    import_snapshots(d / BASES["snapshot"], progress=False).save(d / BASES["timeline"])
    (d / "profiler").mkdir()
    _profiler_trace(d / BASES["profiler"])
    (d / "profiler_gz").mkdir()
    (d / BASES["profiler_gz"]).write_bytes(gzip.compress((d / BASES["profiler"]).read_bytes(), mtime=0))

    (d / "plan").mkdir()
    (d / BASES["plan"]).write_text(workbench.plan(cfg, ParallelConfig(dp_shard=2), seq_len=16).to_json())
    return {k: d / v for k, v in BASES.items()}
