"""Issue 28, finding 9: tutorial 05 shows no red stderr.

Two sources wrote there:

* FSDP2's ``UserWarning: FSDP2-wrapped module (FSDPTransformer) returned a view tensor ... wrong
  gradients``, from every prediction (and run) that combines tensor parallelism with FSDP2: the TP output
  head's ``to_local()`` returns a view. Our logits are only read by the loss, so
  ``compat.quiet_fsdp_view_output_warning`` filters exactly that message for our Transformer.
* kineto's ``USDT: ... profiler_start`` / ``profiler_stop`` lines, written by C++ straight to fd 2 around
  every ``torch.profiler.profile``; the tutorial's profiler cell sets ``KINETO_LOG_LEVEL`` first.

Each check runs the code in a fresh interpreter and reads its stderr pipe, so C-level writes count too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TUTORIAL = REPO / "notebooks" / "05_memory.ipynb"


def _code_cell(marker: str) -> str:
    cells = [c for c in json.loads(TUTORIAL.read_text())["cells"] if c["cell_type"] == "code"]
    hits = ["".join(c["source"]) for c in cells if marker in "".join(c["source"])]
    assert len(hits) == 1, f"{TUTORIAL.name}: {len(hits)} code cells hold {marker!r}"
    return hits[0]


def _stderr_of(code: str, tmp: Path, timeout: float) -> str:
    # Without the caller's KINETO_LOG_LEVEL or PYTHONWARNINGS: the tutorial must be quiet by itself.
    env = {k: v for k, v in os.environ.items() if k not in ("KINETO_LOG_LEVEL", "PYTHONWARNINGS")}
    env["TMPDIR"] = str(tmp)  # the tutorial's temporary directories
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                         cwd=TUTORIAL.parent, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stderr


def test_profiler_cell_writes_nothing_on_stderr(tmp_path):
    imports = _code_cell("import workbench.memory as memory")
    profile = _code_cell("with torch.profiler.profile(")
    err = _stderr_of(imports + "\n" + profile, tmp_path, timeout=240)
    assert err == "", f"the profiler cell of {TUTORIAL.name} writes on stderr:\n{err[:2000]}"


def test_tp_fsdp_prediction_writes_nothing_on_stderr(tmp_path):
    # The llama-70b cell's kind of call (FSDP2 x TP, in this process), on the tiny preset so it takes seconds.
    code = textwrap.dedent("""
        import workbench.memory as memory
        tl = memory.predict("tiny", nproc=4, dp_shard=2, tp=2, train=dict(global_batch=4, seq_len=32, steps=1),
                            progress=False)
        assert tl.peak(0).bytes > 0
    """)
    err = _stderr_of(code, tmp_path, timeout=300)
    assert err == "", f"a tp x FSDP2 prediction writes on stderr:\n{err[:2000]}"


def test_the_filter_is_exactly_our_warning():
    from workbench import compat

    where = dict(filename="_fsdp_state.py", lineno=331, module="torch.distributed.fsdp._fully_shard._fsdp_state")
    tail = " returned a view tensor. An in-place op on this view (e.g., `x += y`) will silently drop ..."
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        compat.quiet_fsdp_view_output_warning()
        warnings.warn_explicit("FSDP2-wrapped module (FSDPTransformer)" + tail, UserWarning, **where)
        warnings.warn_explicit("FSDP2-wrapped module (FSDPSomeoneElsesNet)" + tail, UserWarning, **where)
        warnings.warn_explicit("FSDP2-wrapped module (FSDPTransformer)" + tail, UserWarning, "user.py", 1,
                               module="user")
    # someone else's module, and our class name raised from elsewhere, still warn
    assert [(str(w.message).split(")")[0], w.filename) for w in seen] == [
        ("FSDP2-wrapped module (FSDPSomeoneElsesNet", "_fsdp_state.py"),
        ("FSDP2-wrapped module (FSDPTransformer", "user.py")]

