"""`workbench time calibrate`: this machine measured into a device profile that predictions then use."""

from __future__ import annotations

import json
import math
import os
import subprocess
import time

import pytest

from workbench.time.calibrate import (COLLECTIVES, _ring_time, calibrate, fit_latency_bandwidth, fit_link,
                                      measure_collectives, parse_ranks)

# What any CPU this runs on does, with wide margins: one thread of a laptop to a server core with AMX.
CPU_FLOPS = (1e8, 5e12)


def _fields(profile) -> dict:
    doc = profile.to_json() if hasattr(profile, "to_json") else profile
    return json.loads(doc) if isinstance(doc, str) else dict(doc)


def test_fit_recovers_latency_and_bandwidth_from_exact_points():
    lat, bw = 50e-6, 2e9
    pts = [(b, lat + b / bw) for b in (1 << 10, 1 << 16, 1 << 20, 1 << 24)]
    fit = fit_latency_bandwidth(pts)
    assert fit["latency_s"] == pytest.approx(lat, rel=1e-6)
    assert fit["bytes_per_s"] == pytest.approx(bw, rel=1e-6)
    assert fit["max_rel_error"] < 1e-6
    # noise that makes the time fall with the payload still gives a positive latency and bandwidth
    noisy = fit_latency_bandwidth([(1 << 10, 3e-3), (1 << 20, 2e-3), (1 << 22, 2.5e-3)])
    assert noisy["latency_s"] > 0 and math.isfinite(noisy["bytes_per_s"]) and noisy["bytes_per_s"] > 0
    with pytest.raises(ValueError, match="no .bytes, seconds. points"):
        fit_latency_bandwidth([])


def test_one_link_fitted_through_the_link_model_reproduces_every_collective():
    """Points made by the link model itself (devices' collective_time where it exists) fit back to its link."""
    from workbench.time.calibrate import _link_model

    model = _link_model()
    lat, bw = 30e-6, 5e9
    groups = {str(g): {k: {"points": [[b, model(k, b, g, lat, bw)] for b in (1 << 12, 1 << 18, 1 << 22)],
                           "latency_s": lat, "bytes_per_s": bw} for k in COLLECTIVES} for g in (2, 4)}
    link = fit_link(groups)
    assert link["latency_s"] == pytest.approx(lat, rel=1e-4)
    assert link["bytes_per_s"] == pytest.approx(bw, rel=1e-4)
    assert link["algorithm"] == "ring" and link["max_rel_error"] < 1e-4
    # the ring fallback's shape: all_reduce moves twice what reduce_scatter does
    assert _ring_time("all_reduce", 1e6, 4, 0.0, 1e9) == pytest.approx(2 * _ring_time("reduce_scatter", 1e6, 4, 0.0, 1e9))


def test_ranks_are_parsed_or_refused_in_one_line():
    assert parse_ranks("4,2, 2") == (2, 4)
    assert parse_ranks("") == ()
    for bad, what in (("1", "not a group size"), ("2,x", "not a whole number"), ("100000", "not a group size")):
        with pytest.raises(ValueError, match=what) as e:
            parse_ranks(bad)
        assert "\n" not in str(e.value) and "pass" in str(e.value)


def test_calibrate_without_collectives_gives_plausible_figures_saved_and_reloaded(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_DEVICE_PROFILE_DIR", str(tmp_path / "devices"))
    profile = calibrate(quick=True, ranks="", device="cpu", progress=False)
    f = _fields(profile)
    assert f["name"] == "cpu" and f["calibrated"] is True
    assert f["source"].startswith("workbench time calibrate on ")
    for dt in ("fp32", "bf16"):
        assert CPU_FLOPS[0] < f["matmul_flops"][dt] < CPU_FLOPS[1], (dt, f["matmul_flops"][dt])
    assert 1e8 < f["elementwise_bytes_per_s"] < 1e12
    assert 1e-8 < f["op_overhead_s"] < 1e-3
    assert f["memory_bytes"] > 0
    path = tmp_path / "devices" / "cpu.json"
    assert path.is_file()
    from workbench.time.devices import DeviceProfile, device_profile

    again = DeviceProfile.load(path)
    assert again.matmul_flops == pytest.approx(f["matmul_flops"])
    assert again.op_overhead_s == pytest.approx(f["op_overhead_s"])
    # predictions for device "cpu" find it where calibrate saved it
    found = device_profile("cpu")
    assert found.calibrated is True and found.matmul_flops == pytest.approx(f["matmul_flops"])


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_collectives_on_two_gloo_ranks_fit_latency_plus_bytes_over_bandwidth():
    payloads = (4 << 10, 256 << 10, 8 << 20)
    got = measure_collectives((2,), payloads, repeats=3, timeout_s=90)
    assert got["backend"] == "gloo" and got["world"] == 2 and set(got["groups"]) == {"2"}
    assert got["concurrent"] is None  # no compute asked for
    fits = got["groups"]["2"]
    assert set(fits) == set(COLLECTIVES)
    for kind, fit in fits.items():
        assert [p[0] for p in fit["points"]] == list(payloads), kind
        assert all(p[1] > 0 for p in fit["points"]), kind
        assert 0 < fit["latency_s"] < 1.0, (kind, fit)
        assert 1e6 < fit["bytes_per_s"] <= 1e12 + 1, (kind, fit)  # loopback gloo: MB/s to tens of GB/s
    # moving 2048x the bytes takes longer (median of the slowest rank: robust to a busy machine)
    ar = fits["all_reduce"]["points"]
    assert ar[-1][1] > ar[0][1]


@pytest.mark.multirank
@pytest.mark.timeout(60)
def test_collective_ranks_that_do_not_finish_in_time_are_killed_and_named():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"did not finish within 0.5 s.*--ranks"):
        measure_collectives((2,), (1 << 20,), repeats=50, timeout_s=0.5)
    assert time.monotonic() - t0 < 15
    # no rank is left behind: none of this process's children is a calibration worker
    out = subprocess.run(["ps", "-o", "args=", "--ppid", str(os.getpid())], capture_output=True, text=True).stdout
    assert "--rank-worker" not in out


@pytest.mark.multirank
@pytest.mark.timeout(180)
def test_cli_json_document_names_the_profile_it_saved_and_predictions_load_it(tmp_path, workbench_cli):
    env = dict(os.environ, WORKBENCH_DEVICE_PROFILE_DIR=str(tmp_path / "devices"))
    proc = subprocess.run([*workbench_cli, "time", "calibrate", "--quick", "--ranks", "2", "--json"],
                          capture_output=True, text=True, timeout=170, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["status"] == "ok" and doc["path"] == str(tmp_path / "devices" / "cpu.json")
    prof = doc["profile"]
    assert prof["name"] == "cpu" and prof["calibrated"] is True
    assert CPU_FLOPS[0] < prof["matmul_flops"]["fp32"] < CPU_FLOPS[1]
    link = prof["links"]["intra"]
    assert 0 < link["latency_s"] < 1.0 and link["bytes_per_s"] > 1e6
    saved = json.loads((tmp_path / "devices" / "cpu.json").read_text())
    assert saved["matmul_flops"] == pytest.approx(prof["matmul_flops"])
    # a CPU rank's figures are one thread's alone, and the profile says how many cores ranks share (the
    # prediction shares them out); what each of the 2 ranks sustained while both computed is kept beside them
    measured = saved["measured"]
    concurrent = measured["collectives"]["concurrent"]
    assert prof["matmul_flops"]["fp32"] == pytest.approx(max(measured["matmul"]["float32"].values()))
    assert prof["cores"] == measured["usable_cpus"] >= 1
    assert max(concurrent["matmul"]["float32"].values()) > 0
    assert "while 2 ranks" in prof["assumptions"]["per_rank"]
    assert set(measured["collectives"]["groups"]["2"]) == set(COLLECTIVES)


@pytest.mark.parametrize("argv, message", [
    (["--ranks", "1"], "not a group size"),
    (["--ranks", "2,x"], "not a whole number"),
    (["--timeout", "0"], "timeout"),
    (["--device", "tpu"], "invalid choice"),
    (["--frobnicate"], "unrecognized arguments"),
])
def test_cli_refuses_bad_flags_in_one_line(argv, message, workbench_cli, tmp_path):
    proc = subprocess.run([*workbench_cli, "time", "calibrate", *argv], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, WORKBENCH_DEVICE_PROFILE_DIR=str(tmp_path)))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], proc.stderr
    assert not list(tmp_path.iterdir())  # refused before measuring anything


def test_cli_refuses_an_out_path_under_a_file(workbench_cli, tmp_path):
    (tmp_path / "afile").write_text("x")
    proc = subprocess.run([*workbench_cli, "time", "calibrate", "--out", str(tmp_path / "afile" / "p.json"), "--json"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    doc = json.loads(proc.stdout)
    assert doc["status"] == "error" and "which is a file" in doc["error"]


def test_cli_text_names_each_figure_and_says_an_unmeasured_link_is_the_default(workbench_cli, tmp_path):
    out = tmp_path / "prof.json"
    proc = subprocess.run([*workbench_cli, "time", "calibrate", "--quick", "--ranks", "", "--device", "cpu",
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = proc.stdout
    for word in ("cpu: calibrated in", "matmul", "fp32", "elementwise", "op overhead", f"saved {out}"):
        assert word in text, (word, text)
    assert "default, not measured" in text
    assert json.loads(out.read_text())["calibrated"] is True
