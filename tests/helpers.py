"""Small helpers shared by the tests that follow real processes."""

from __future__ import annotations

import time


def wait_for(pred, timeout: float = 60.0):
    """Poll ``pred`` every 50 ms until it returns something truthy (returned), or raise TimeoutError."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError("condition not met")


def wait_for_server(proc, ready, what: str, log_tail=lambda: "", timeout: float = 60.0):
    """Poll ``ready()`` (a request to a starting server) every 0.25 s until it returns something truthy,
    which is returned; an OSError from it means "not yet". Fails the test, with the server's log, when
    ``proc`` exits first or ``timeout`` seconds pass."""
    import pytest

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited with code {proc.returncode}:\n{log_tail()}")
        try:
            value = ready()
            if value:
                return value
        except OSError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not answer within {timeout:.0f} s:\n{log_tail()}")
        time.sleep(0.25)


def train_step(st, rows) -> float:
    """One language-model step of a TrainState on ``rows`` (B, L+1) (next-token loss, AdamW, scheduler),
    counted in ``st.step``; returns the loss."""
    import torch.nn.functional as F

    loss = F.cross_entropy(st.model(rows[:, :-1]).flatten(0, 1), rows[:, 1:].flatten())
    loss.backward()
    st.optimizer.step()
    st.optimizer.zero_grad(set_to_none=True)
    st.scheduler.step()
    st.step += 1
    return float(loss.detach())


def launch_tiny(tmp_path_factory, name: str, steps: int, seed: int, timeout: float, **kw):
    """A finished ``workbench.launch("tiny", ...)`` run in a fresh directory named ``name``."""
    import workbench

    return workbench.launch("tiny", out=tmp_path_factory.mktemp(name), steps=steps, seed=seed, **kw).wait(timeout)


def rank0_metrics(run):
    """Rank 0's metrics of ``run``, indexed by step."""
    df = run.metrics
    return df[df["rank"] == 0].set_index("step")


def spawn_ranks(target, args_of, results: list, timeout: float) -> list[dict]:
    """Run ``target(*args_of(r))`` for every rank in its own spawned process (real process groups), wait at
    most ``timeout`` seconds for all of them (then kill what is left: a hang fails fast), and return each
    rank's JSON result file, asserting every rank wrote one with ``"ok": true`` (its traceback otherwise)."""
    import json
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=args_of(r)) for r in range(len(results))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    out = []
    for r, path in enumerate(results):
        assert path.exists(), f"rank {r} died without a result (exit {procs[r].exitcode})"
        res = json.loads(path.read_text())
        assert res["ok"], f"rank {r}:\n{res['traceback']}"
        out.append(res)
    return out
