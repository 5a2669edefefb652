"""Benchmarks print one JSON document of ratios against a named baseline measured in the same run."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

LAYOUTS = {"single", "single_1thread", "ddp", "fsdp2", "tp", "tp_sp"}


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_bench_train_quick_prints_one_json_document_of_ratios(repo):
    proc = subprocess.run(
        [sys.executable, str(repo / "benchmarks" / "bench_train.py"), "--quick", "--repeats", "1"],
        capture_output=True, text=True, timeout=200, cwd=repo,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(proc.stdout)  # stdout is exactly one JSON document; progress went to stderr
    assert "tokens/s" in proc.stderr

    assert doc["benchmark"] == "bench_train"
    assert doc["baseline"] == "single" and doc["preset"] == "tiny"
    assert doc["quick"] is True and doc["repeats"] == 1
    assert doc["steps"] > doc["warmup_steps_dropped"] >= 0
    machine = doc["machine"]
    for key in ("cpu_count", "torch", "platform", "omp_note"):
        assert machine[key], key

    configs = doc["configs"]
    assert set(configs) == LAYOUTS
    assert configs["single"]["ratio"] == 1.0
    assert configs["single"]["nproc"] == 1
    for name, c in configs.items():
        tps = c["tokens_per_s"]
        assert len(tps["runs"]) == 1, name
        for key in ("median", "min", "max"):
            assert math.isfinite(tps[key]) and tps[key] > 0, (name, key, tps[key])
        assert tps["min"] <= tps["median"] <= tps["max"]
        assert math.isfinite(c["ratio"]) and c["ratio"] > 0, (name, c["ratio"])
        assert math.isclose(c["ratio"], tps["median"] / configs["single"]["tokens_per_s"]["median"])
        assert c["omp_threads_per_rank"] >= 1
        if name != "single":
            assert c["nproc"] == 2, name
    assert configs["tp_sp"]["layout"] == "tp=2 x sp"
    assert configs["fsdp2"]["layout"] == "dp_shard=2"
    assert configs["ddp"]["layout"] == "dp_replicate=2"
