"""The jupyter_server extension behind the JupyterLab views, over HTTP against a real ``jupyter server``.

One server (module scope, free port, fresh token) serves a root directory of real files made by our
own code: a 2-step ``workbench.launch`` run (its run directory and its DCP checkpoint), that checkpoint's
safetensors exports (sharded with an index, and one file), a torch memory snapshot in torch's pickle
format with a known peak, a plan JSON, plus a corrupt file, hostile pickles, and paths that escape the
root. Each endpoint is checked for content (key names, statistics, peak bytes, per-rank bytes, losses)
against the core called in-process, and every bad input for its one-line error.
"""

from __future__ import annotations

import json
import os
import re
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest
import torch

from helpers import wait_for_server  # tests/helpers.py

REPO = Path(__file__).resolve().parents[1]
SERVER_START_S = 60

pytestmark = pytest.mark.timeout(120)


class _Exploit:
    """Unpickled, it would create ``target``: proof that nothing was unpickled if the file stays absent."""

    def __init__(self, target: Path):
        self.target = str(target)

    def __reduce__(self):
        return (open, (self.target, "w"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, url: str, token: str, root: Path, proc: subprocess.Popen, log: Path):
        self.url, self.token, self.root, self.proc, self.log = url, token, root, proc, log

    def get(self, endpoint: str, token: bool = True, **params) -> tuple[int, dict]:
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        req = urllib.request.Request(f"{self.url}/workbench/api/{endpoint}?{query}",
                                     headers={"Authorization": f"token {self.token}"} if token else {})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as e:
            body = e.read()
            try:
                return e.code, json.loads(body)
            except json.JSONDecodeError:
                return e.code, {"raw": body.decode(errors="replace")}

    def ok(self, endpoint: str, **params) -> dict:
        status, body = self.get(endpoint, **params)
        assert status == 200, (endpoint, params, status, body)
        return body

    def error(self, endpoint: str, status: int, **params) -> str:
        got, body = self.get(endpoint, **params)
        assert got == status, (endpoint, params, got, body)
        msg = body["error"]
        assert isinstance(msg, str) and "\n" not in msg and "Traceback" not in msg and ";" in msg, msg
        return msg

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


def _start_server(base: Path, root: Path) -> Server:
    for d in ("config", "data", "runtime"):
        (base / d).mkdir()
    # Enabled explicitly (the installed config file enables it too), and the other extensions off: a
    # quick start, and the same test under an interpreter whose environment did not install ours.
    (base / "config" / "jupyter_server_config.json").write_text(json.dumps({"ServerApp": {"jpserver_extensions": {
        "workbench.jupyter": True, "jupyterlab": False, "jupyter_lsp": False, "notebook_shim": False,
        "jupyter_server_terminals": False}}}))
    port, token = _free_port(), uuid.uuid4().hex
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(base / "config"), JUPYTER_DATA_DIR=str(base / "data"),
               JUPYTER_RUNTIME_DIR=str(base / "runtime"), JUPYTER_PLATFORM_DIRS="1", PYTHONUNBUFFERED="1")
    env["XDG_CACHE_HOME"] = str(base / "cache")  # parsed snapshots are cached there, not in the user's ~/.cache
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "jupyter_server", "--no-browser", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={root}", "--ServerApp.allow_root=True", "--ServerApp.terminals_enabled=False"]
    log = base / "server.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=base, start_new_session=True)
    return Server(f"http://127.0.0.1:{port}", token, root, proc, log)


def _wait_ready(server: Server) -> None:
    def status() -> bool:
        req = urllib.request.Request(f"{server.url}/api/status", headers={"Authorization": f"token {server.token}"})
        with urllib.request.urlopen(req, timeout=2) as resp:
            return resp.status == 200

    wait_for_server(server.proc, status, "jupyter server", server.log_tail, SERVER_START_S)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            proc.wait(5)


def _metadata_pointing_outside(step: Path, dst: Path) -> None:
    """A copy of a DCP step whose .metadata places every chunk in a file outside the server's root."""
    import dataclasses

    from workbench.checkpoint.safeload import read_dcp_metadata

    shutil.copytree(step, dst)
    (dst / "workbench.json").unlink()
    md = read_dcp_metadata(dst)
    md.storage_data = {k: dataclasses.replace(v, relative_path="../../outside/" + v.relative_path)
                       for k, v in md.storage_data.items()}
    (dst / ".metadata").write_bytes(pickle.dumps(md))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    """The root directory's files, each made by our own code, and what they should answer."""
    import workbench
    from workbench.checkpoint.formats import export
    from workbench.memory.snapshot import write_synthetic_snapshot

    base = tmp_path_factory.mktemp("jserver")
    root = base / "root"
    root.mkdir()
    run = workbench.launch("tiny", out=root / "run", nproc=1, steps=2, ckpt_every=2, seed=0)
    server = _start_server(base, root)  # starts while the run trains
    try:
        truth = write_synthetic_snapshot(root / "snapshot_rank0.pickle", 400_000, seed=3)
        plan = workbench.plan("tiny", workbench.ParallelConfig(dp_shard=2, tp=2))
        (root / "plan.json").write_text(plan.to_json())
        (root / "corrupt.safetensors").write_bytes((10**6).to_bytes(8, "little") + b"{not json" + b"\0" * 64)
        (root / "notes.json").write_text(json.dumps({"hello": 1}))
        marker = base / "pwned"
        (root / "hostile.pickle").write_bytes(pickle.dumps(
            {"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "size": 8, "time_us": 1,
                                                 "frames": [_Exploit(marker)]}]]}))
        torch.save({"w": torch.ones(2), "x": _Exploit(marker)}, root / "hostile.pt")
        outside = base / "outside"
        outside.mkdir()
        (outside / "secret.json").write_text(json.dumps({"summary": {}, "parallel": {}, "tensors": []}))
        (root / "escape").symlink_to(outside, target_is_directory=True)
        run.wait(90)
        _metadata_pointing_outside(root / STEP, root / "evil_step")
        export(root / "run", root / "hf", to="hf", progress=False)
        export(root / "run", root / "model.safetensors", to="safetensors", progress=False)
        export(root / "run", root / "model.pt", to="torch", progress=False)
        shutil.copytree(root / STEP, root / "plain_dcp")  # a DCP directory that is not ours
        (root / "plain_dcp" / "workbench.json").unlink()
        _wait_ready(server)
        yield {"root": root, "base": base, "server": server, "run": run, "snapshot_truth": truth, "plan": plan,
               "marker": marker}
    finally:
        _stop(server.proc)


@pytest.fixture(scope="module")
def server(files) -> Server:
    return files["server"]


STEP = "run/checkpoints/step-000002"


def test_open_names_the_view_of_each_file(server, files):
    cases = {
        "run": ("run", "run"), "run/events.jsonl": ("run", "run"),
        STEP: ("checkpoint", "workbench"), "run/checkpoints": ("checkpoint", "workbench"),
        "hf": ("checkpoint", "hf"), "hf/model.safetensors.index.json": ("checkpoint", "hf"),
        "hf/model-00001-of-00001.safetensors": ("checkpoint", "safetensors"),
        "model.safetensors": ("checkpoint", "safetensors"), "model.pt": ("checkpoint", "torch"),
        "plain_dcp": ("checkpoint", "dcp"),
        "snapshot_rank0.pickle": ("snapshot", "snapshot"), "plan.json": ("plan", "plan"),
    }
    for path, (view, fmt) in cases.items():
        body = server.ok("open", path=path)
        assert (body["view"], body["format"]) == (view, fmt), (path, body)
    assert server.ok("open", path="run/checkpoints")["checkpoint"] == STEP
    assert server.ok("open", path=STEP)["step"] == 2
    assert server.ok("open", path="plan.json")["world_size"] == 4
    # corrupt, hostile, not ours: one line, 422
    assert "corrupt.safetensors" in server.error("open", 422, path="corrupt.safetensors")
    assert "hostile.pt" in server.error("open", 422, path="hostile.pt")
    assert "not a workbench plan" in server.error("open", 422, path="notes.json")
    assert "(hostile)" not in server.error("open", 404, path="no/such/file")
    # outside the root (by .. or by a symlink) answers as a path that does not exist: the same 404, word for word
    missing = server.error("open", 404, path="escape/no-such.json")
    assert server.error("open", 404, path="../outside/secret.json") == missing.replace("escape/no-such.json",
                                                                                        "../outside/secret.json")
    assert server.error("open", 404, path="escape/secret.json") == missing.replace("no-such", "secret")
    # "/x" is "x" under the root, as in the contents API: an absolute path of the machine is not found
    assert "no such file" in server.error("open", 404, path=str(files["base"] / "outside" / "secret.json"))
    assert server.ok("open", path="/plan.json")["path"] == "plan.json"
    assert "hidden" in server.error("open", 403, path="run/checkpoints/step-000002/.metadata")
    assert "missing ?path=" in server.error("open", 400)
    msg = server.error("open", 404, path="evil_step")  # its .metadata names data files outside the root
    assert "a path outside its directory" in msg and "evil_step/.metadata" in msg
    assert "outside its directory" in server.error("checkpoint/tensor", 404, path="evil_step",
                                                   key="model.tok_embeddings.weight")
    assert not files["marker"].exists()


def test_manifest_pages_and_filters_the_key_table(server, files):
    from workbench.checkpoint import inspect

    m = inspect(files["root"] / STEP)
    body = server.ok("checkpoint/manifest", path="run", limit=5)
    assert body["path"] == STEP and body["total"] == len(m) and len(body["rows"]) == 5
    assert [r["key"] for r in body["rows"]] == m.keys[:5]
    first = body["rows"][0]
    row = m.row(first["key"])
    assert (first["dtype"], first["shape"], first["kind"], first["bytes"]) == (
        row["dtype"], list(row["shape"]), row["kind"], row["bytes"])
    assert first["ranks"] == [0] and re.fullmatch(r"__0_\d+\.distcp", first["shards"][0]["file"])
    assert first["shards"][0]["file"] == m.shards().query("key == @first['key']")["file"].iloc[0]
    s = body["summary"]
    assert s["step"] == 2 and s["bytes_by_kind"]["model"] == m.summary()["bytes_by_kind"]["model"]
    assert sum(f["bytes"] for f in body["shard_map"]) >= s["total_bytes"]
    nxt = server.ok("checkpoint/manifest", path="run", offset=5, limit=5)
    assert [r["key"] for r in nxt["rows"]] == m.keys[5:10]
    optim = server.ok("checkpoint/manifest", path=STEP, kind="optimizer", filter="STATE.LAYERS.0.attention.wq.", limit=50)
    assert optim["total"] == 3 and {r["key"].rsplit(".", 1)[1] for r in optim["rows"]} == {"exp_avg", "exp_avg_sq", "step"}
    hf = server.ok("checkpoint/manifest", path="hf/model.safetensors.index.json", limit=2000)
    assert hf["summary"]["format"] == "hf" and "model.embed_tokens.weight" in {r["key"] for r in hf["rows"]}
    assert "must be" not in server.error("checkpoint/manifest", 400, path=STEP, limit="lots")


def test_tensor_statistics_and_histogram_come_from_the_core(server, files):
    from workbench.checkpoint import tensor_stats

    key = "model.layers.0.attention.wq.weight"
    want = tensor_stats(files["root"] / STEP, key, bins=16)
    for path in (STEP, "model.safetensors", "model.pt", "plain_dcp"):
        got = server.ok("checkpoint/tensor", path=path, key=key, bins=16)
        assert got["numel"] == want["numel"] and got["shape"] == [128, 128]
        for k in ("mean", "std", "min", "max", "norm"):
            assert got[k] == pytest.approx(want[k], rel=1e-6), k
        assert got["histogram"]["counts"] == want["histogram"]["counts"]
        assert sum(got["histogram"]["counts"]) == got["numel"]
    msg = server.error("checkpoint/tensor", 404, path=STEP, key="model.layers.0.attention.wq.weigth")
    assert "did you mean" in msg and "wq.weight" in msg
    assert "missing ?key=" in server.error("checkpoint/tensor", 400, path=STEP)


def test_verify_diff_and_the_load_dry_run(server, files):
    v = server.ok("checkpoint/verify", path=STEP)
    assert v["ok"] and v["format"] == "workbench" and v["checked"]["files_hashed"] >= 2
    d = server.ok("checkpoint/diff", path=STEP, other="model.safetensors")
    assert d["a"] == STEP and d["b"] == "model.safetensors"
    # what the weights-only export has none of is "only in A", by kind: not a difference in tensors
    assert d["n_added"] == d["n_removed"] == 0 and d["only_in_a"] and "model" not in d["only_in_a"]
    assert d["n_compared"] == d["n_equal"] > 0  # the export holds the same weights, bit for bit
    assert d["verdict"] == "equal" and d["banner"].startswith("tensors equal")
    assert "no such file" in server.error("checkpoint/diff", 404, path=STEP, other="../outside")
    ok = server.ok("checkpoint/plan-load", path=STEP, tp=2, dp_shard=1)
    assert ok["loadable"] and ok["world_size"] == 2 and ok["reasons"] == []
    bad = server.ok("checkpoint/plan-load", path=STEP, tp=3, dp_shard=1)
    assert not bad["loadable"] and bad["reasons"][0].startswith("layout: ")
    assert "nproc" in server.error("checkpoint/plan-load", 400, path=STEP, nproc="two")
    # like=: the layout (and model) of a picked run directory or plan JSON
    like = server.ok("checkpoint/plan-load", path=STEP, like="plan.json")
    assert like["like"] == "plan.json" and like["world_size"] == 4 and like["loadable"], like
    assert "dp_shard=2" in like["target_description"] and "tp=2" in like["target_description"]
    own = server.ok("checkpoint/plan-load", path=STEP, like="run")
    assert own["loadable"] and own["world_size"] == 1
    assert "'parallel'" in server.error("checkpoint/plan-load", 422, path=STEP, like="notes.json")
    assert "both" in server.error("checkpoint/plan-load", 400, path=STEP, like="run", to="tp=2")


def test_memory_timeline_downsamples_the_visible_window_and_keeps_the_peak(server, files):
    truth = files["snapshot_truth"]
    body = server.ok("memory/timeline", path="snapshot_rank0.pickle", points=200)
    assert body["ranks"] == [0] and body["source"] == "snapshot"
    r = body["per_rank"][0]
    assert r["peak"]["bytes"] == truth["peak_bytes"] and r["base_bytes"] == truth["base_bytes"]
    assert r["window_peak"]["bytes"] == truth["peak_bytes"] == max(r["total_bytes"])  # never smoothed away
    assert len(r["t"]) <= 200 < r["events"] and len(r["total_bytes"]) == len(r["t"])
    assert r["peak"]["alive"] and r["peak"]["alive"][0]["bytes"] > 0
    assert sum(r["peak"]["by_category"].values()) == truth["peak_bytes"]
    assert {"parameter", "activation"} <= set(r["categories"])
    t_min, t_max = body["t_range"]
    t0, t1 = t_min + (t_max - t_min) * 0.4, t_min + (t_max - t_min) * 0.5
    zoom = server.ok("memory/timeline", path="snapshot_rank0.pickle", t0=t0, t1=t1, points=100)
    z = zoom["per_rank"][0]
    assert zoom["window"] == [t0, t1] and len(z["t"]) <= 101 and z["events_in_window"] < r["events"]
    assert all(t0 <= t <= t1 for t in z["t"][1:]) and z["t"][0] <= t0  # + the level the window starts at
    start = time.monotonic()
    again = server.ok("memory/timeline", path="snapshot_rank0.pickle", t0=t0, t1=t1, points=100)
    assert again == zoom and time.monotonic() - start < 2  # cached: no second parse
    msg = server.error("memory/timeline", 422, path="hostile.pickle")
    assert "refers to io.open; refusing to load it" in msg and "hostile.pickle" in msg
    assert not files["marker"].exists()
    assert "rank 3" in server.error("memory/timeline", 404, path="snapshot_rank0.pickle", rank=3)
    assert "before t0" in server.error("memory/timeline", 400, path="snapshot_rank0.pickle", t0=2, t1=1)


def _cache_entry(cache: Path) -> Path:
    """The one finished entry of the timeline cache (written by the parse thread after its answer)."""
    for _ in range(200):
        done = [d for d in cache.glob("parallel-workbench/timelines/*") if not d.name.startswith(".")]
        if done and not list(cache.glob("parallel-workbench/timelines/.tmp-*")):
            return done[0]
        time.sleep(0.05)
    raise AssertionError(f"no timeline cache entry under {cache}")


def test_parsed_snapshot_is_cached_on_disk_and_a_bad_entry_is_rebuilt(tmp_path, monkeypatch):
    from workbench.jupyter import timelines
    from workbench.memory.snapshot import write_synthetic_snapshot

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = tmp_path / "root"
    root.mkdir()
    truth = write_synthetic_snapshot(root / "s_rank0.pickle", 200_000, seed=5, n_frames=10)
    p = (root / "s_rank0.pickle").resolve()

    def fresh(**kw) -> dict:
        timelines._JOBS.clear()  # as a new server would: nothing in memory
        body = timelines.timeline_window(root, p, points=300, **kw)
        assert body["complete"] and body["per_rank"][0]["peak"]["bytes"] == truth["peak_bytes"]
        return body

    first = fresh()
    assert not first["parse"]["cached"]
    # the part read, as the view draws it while reading: at 100% its largest rise is the peak over the base
    (job,) = timelines._JOBS.values()
    progress = job.progress(100)
    assert progress["fraction"] == 1.0 and progress["bytes_total"] == p.stat().st_size
    assert progress["per_rank"][0]["max_delta_bytes"] == truth["peak_bytes"] - truth["base_bytes"]
    entry = _cache_entry(tmp_path / "cache")
    assert sorted(f.name for f in entry.iterdir()) == ["rank0.json", "rank0.npz", "source.json"]
    second = fresh()
    assert second["parse"]["cached"] and {**second, "parse": None} == {**first, "parse": None}
    (entry / "rank0.npz").write_bytes(b"not an npz")  # damaged: ignored, removed, read again
    third = fresh()
    assert not third["parse"]["cached"] and {**third, "parse": None} == {**first, "parse": None}
    _cache_entry(tmp_path / "cache")  # rebuilt
    assert fresh()["parse"]["cached"]
    st = p.stat()
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file changed: the entry is stale
    assert not fresh()["parse"]["cached"]
    _cache_entry(tmp_path / "cache")
    assert len(list((tmp_path / "cache").glob("parallel-workbench/timelines/*"))) == 1  # the old one went


def test_plan_per_rank_table(server, files):
    plan = files["plan"]
    rb = plan.rank_bytes()
    body = server.ok("plan", path="plan.json")
    assert body["world_size"] == 4 and body["layout"] == plan.layout and len(body["rows"]) == 4
    for row in body["rows"]:
        for c in ("parameter", "gradient", "optimizer", "total"):
            assert row[c] == int(rb.loc[row["rank"], c]), (row, c)
    assert body["rows"][3]["coords"] == {"pp": 0, "dp_replicate": 0, "dp_shard": 1, "tp": 1}
    assert sum(g["count"] for g in body["distinct"]) == 4
    assert body["summary"]["n_params"] == plan.n_params
    assert server.ok("plan", path="plan.json", offset=2, limit=1)["rows"][0]["rank"] == 2
    assert "not a workbench plan" in server.error("plan", 422, path="notes.json")


def test_run_events_are_incremental_with_status_and_losses(server, files):
    text = (files["root"] / "run" / "events.jsonl").read_text()
    lines = [json.loads(x) for x in text.replace(f"{files['root']}/", "").splitlines()]  # paths: root-relative
    assert any(e.get("path") == STEP for e in lines)
    losses = [e["loss"] for e in lines if e["type"] == "step"]
    body = server.ok("run/events", path="run")
    assert body["total"] == len(lines) == body["next"] and body["events"] == lines
    assert body["status"] == "succeeded" and body["summary"]["final_loss"] == losses[-1]
    assert body["summary"]["first_loss"] == losses[0] and body["summary"]["checkpoints"] == [2]
    assert body["summary"]["model"] == "tiny"
    steps = server.ok("run/events", path="run/events.jsonl", since=1, types="step", points=1)
    assert [e["loss"] for e in steps["events"]] == losses and steps["since"] == 1
    assert steps["series"]["0"]["loss"] == [pytest.approx(sum(losses) / len(losses))]
    assert server.ok("run/events", path="run", since=len(lines))["events"] == []
    page = server.ok("run/events", path="run", since=0, limit=2)
    assert page["next"] == 2 and page["events"] == lines[:2]
    assert "events.jsonl" in server.error("run/events", 404, path="hf")
    # the way into RUN_DIR/checkpoints, which JupyterLab's file browser cannot enter
    assert body["checkpoints"] == [{"step": 2, "path": STEP, "latest": True}]
    # a pp = 1 run has no pipeline timeline (tests/test_lab_extension.py draws a pp = 2 one)
    assert "pipeline" not in body["summary"]
    assert "pp > 1" in server.error("run/pipeline", 404, path="run")
    assert "step" in server.error("run/pipeline", 400, path="run", step="last")


def test_requests_need_the_token_and_unknown_endpoints_say_which_exist(server):
    status, _ = server.get("open", token=False, path="plan.json")
    assert status == 403
    assert "checkpoint/manifest" in server.error("nope", 404)
