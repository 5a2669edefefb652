"""The mutation fuzzer: 500 seeded mutations of a valid file per format (snapshot, profiler trace, saved
timeline, DCP, HF, safetensors, torch.save, run directory, plan JSON, model config.json), each read
through the public API in a forked child with memory and time caps (``hostile_fuzz``, ``hostile_harness``).
Every count of crashes, hangs, undeclared exceptions, reads outside the input's directory, lost files and
code run must be 0. ``--hostile-long`` runs 20 times as many inputs (the figures in docs/benchmarks.md).

A first test shows the harness catches each of those, with readers made to misbehave on purpose.
"""

from __future__ import annotations

import pytest

from hostile_fuzz import LONG_FACTOR

PER_FORMAT = 500
FORMATS = {"snapshot", "profiler", "timeline", "dcp", "hf", "safetensors", "torch", "run", "plan", "config"}
FAILURES = ("crash", "hang", "undeclared", "outside", "lost", "executed", "harness")


@pytest.mark.timeout(240)
def test_the_harness_counts_every_kind_of_failure(hostile_driver):
    got = hostile_driver.ask({"cmd": "selftest"}, timeout=200)["outcomes"]
    assert got == {
        "well-behaved reader": "ok",
        "documented error naming the file": "refused",
        "documented error naming nothing": "vague",
        "TypeError": "undeclared",
        "ValueError from inside json": "undeclared",
        "multi-line message": "undeclared",
        "allocates 8 GiB": "undeclared",
        "opens the canary": "outside",
        "opens the canary from C": "outside",
        "lists the outside directory": "outside",
        "opens /etc/passwd": "outside",
        "writes outside": "outside",
        "os.system": "executed",
        "deletes a file of the input": "lost",
        "segfaults": "crash",
        "sleeps past the time cap": "hang",
        "spins past the CPU cap": "hang",
    }, got


@pytest.mark.timeout(900)
def test_mutation_fuzz_finds_no_crash_hang_undeclared_error_outside_read_or_lost_file(hostile_driver, hostile_long):
    n = PER_FORMAT * (LONG_FACTOR if hostile_long else 1)
    doc = hostile_driver.ask({"cmd": "fuzz", "per_format": n, "seed": 0}, timeout=880 if not hostile_long else 20_000)
    per = doc["per_format"]
    assert set(per) == FORMATS
    for fmt, c in per.items():
        assert c["inputs"] == n and c["calls"] >= n - c["crash"] - c["hang"], (fmt, c)
        assert c["ok"] + c["refused"] + c["vague"] + c["undeclared"] + c["accepted"] + c["outside_calls"] \
            + c["executed_calls"] == c["calls"], (fmt, c)
        assert c["ok"] > 0 and c["refused"] + c["vague"] > 0, f"{fmt}: the mutations reach no reader's checks: {c}"
    bad = {fmt: {k: c[k] for k in FAILURES if c[k]} for fmt, c in per.items()}
    bad = {fmt: v for fmt, v in bad.items() if v}
    table = "\n".join(f"  {fmt:<12} " + " ".join(f"{k}={c[k]}" for k in ("inputs", "ok", "refused", *FAILURES))
                      for fmt, c in per.items())
    assert not bad, (f"seed {doc['seed']}, {doc['inputs']} inputs in {doc['seconds']} s:\n{table}\n"
                     f"failures (rerun one: python tests/hostile/hostile_fuzz.py --only KEY --keep):\n{doc['summary']}")
