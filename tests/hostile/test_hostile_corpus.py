"""The adversarial corpus (``hostile_corpus``), read by every reader of its family (``hostile_readers``)
in forked children under the hostile harness: evil pickles (GLOBAL, STACK_GLOBAL, REDUCE, INST, OBJ,
NEWOBJ, BUILD, PERSID, EXT), lying headers (safetensors lengths, offsets, dtypes, shapes; zip directories;
npy headers), deep nesting (JSON, pickle), memo and DUP/MARK bombs, FIFOs, links out of the directory (to
/etc/passwd, /dev/zero, a canary outside the root), non-UTF-8 bytes, huge claimed sizes, truncations.

Each (case, reader) must end in a documented outcome: a value, or the reader's documented error with one
line naming the file (for the command line: ``error:`` lines and exit 1 or 2, or one JSON document) --
never a crash, a hang, an undeclared exception, a read outside the input's directory, code run, or a
changed file.
"""

from __future__ import annotations

import pytest

FAMILIES = ["snapshot", "profiler", "timeline", "checkpoint", "run", "plan", "config"]
FAILURES = ("crash", "hang", "undeclared", "outside", "outside_calls", "lost", "executed", "executed_calls", "harness")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_reader_meets_every_hostile_input_with_a_documented_outcome(hostile_driver, family):
    doc = hostile_driver.ask({"cmd": "corpus", "families": [family], "brief": True}, timeout=580)
    c = doc["per_family"][family]
    assert c["inputs"] >= 10 and c["calls"] >= c["inputs"], c
    bad = {k: c[k] for k in FAILURES if c[k]}
    assert not bad, (f"{family}: {c['inputs']} hostile inputs, {c['calls']} reads: {bad}\n"
                     f"(rerun one: python tests/hostile/hostile_fuzz.py --case 'NAME' --keep)\n{doc['summary']}")
