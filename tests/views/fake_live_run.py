"""A run that writes its events as fast as a test asks: a real process and a real ``events.jsonl``, no torch.

The dashboard follows it exactly as it follows a torchrun job (:class:`workbench.Run` reads the file and
polls the process), so its redraw rate can be measured at any step rate, which a real tiny run on two loaded
cores cannot reach. The process has a session of its own, so ``Run.stop()`` (SIGTERM to its group) stops
it and nothing else; it also ends when the process that started it does (a test that failed before its
Stop, or a kernel shut down), so a 10^7-step run never outlives its test.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from workbench.train.launcher import Run, build_job

# argv: events.jsonl, ranks, steps, steps per second, seconds of silence after the last step.
WRITER = r"""
import json, os, sys, time
parent = os.getppid()
path, ranks, steps, rate, quiet_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
with open(path, "a") as f:
    def emit(**e):
        f.write(json.dumps({"time": time.time(), **e}) + "\n")
        f.flush()
    emit(type="launch", rank=-1, nproc=ranks)
    for r in range(ranks):
        emit(type="start", rank=r)
    t0 = time.monotonic()
    for s in range(steps):
        if os.getppid() != parent:  # whoever started it is gone
            sys.exit(0)
        for r in range(ranks):
            emit(type="step", rank=r, step=s, loss=5.0 / (1 + 0.01 * s), tokens_per_s=1000.0 + s,
                 step_time_s=1.0 / rate, mem_bytes=(100 + r) * 2**20, grad_norm=1.0 + 1.0 / (1 + s), lr=3e-4)
        time.sleep(max(0.0, t0 + (s + 1) / rate - time.monotonic()))
    time.sleep(quiet_s)
    emit(type="run_end", rank=-1, status="succeeded")
"""


def fake_run(run_dir: Path, steps: int, rate: float, ranks: int = 2, quiet_s: float = 0.0) -> Run:
    """Start writing ``steps`` steps of ``ranks`` ranks at ``rate`` steps a second into ``run_dir``, then
    ``quiet_s`` seconds of nothing, then a ``run_end``; the process exits right after it."""
    run_dir.mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(run_dir / "events.jsonl"), str(ranks), str(steps),
                             str(rate), str(quiet_s)], start_new_session=True, stdin=subprocess.DEVNULL)
    job = build_job("tiny", nproc=ranks, dp_shard=ranks, steps=steps)
    return Run(job, run_dir, proc, run_dir / "launcher.log")
