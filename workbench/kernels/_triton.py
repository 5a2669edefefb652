"""The one place that loads Triton, and decides whether its kernels compile for CUDA or run in its
interpreter.

Triton picks interpreter or compiler when a kernel is *decorated* (``TRITON_INTERPRET=1`` at import of
``triton.language``), not when it is launched. So on a machine without CUDA, ``import workbench`` calls
:func:`prepare` before anything imports Triton (torch's compiler does, lazily): it sets
``TRITON_INTERPRET=1`` unless the user set it either way. Then every Triton kernel of ours runs on CPU
tensors through the interpreter, which is how CI checks them. With CUDA nothing is set and the kernels
compile for the GPU.

:func:`status` answers, without raising, whether Triton kernels can run here and on which device.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TritonStatus:
    """Whether our Triton kernels can run in this process, and on what."""

    usable: bool
    interpret: bool  # kernels run through Triton's interpreter on CPU tensors
    version: str | None
    why: str | None  # one line: why not, and the fix (None when usable)

    def device_ok(self, device: torch.device) -> str | None:
        """None when a kernel can run on ``device``; else one line naming the problem and the fix."""
        if not self.usable:
            return self.why
        if device.type == "cuda" and not self.interpret:
            return None
        if device.type == "cpu" and self.interpret:
            return None
        if device.type == "cpu":
            return ("Triton kernels need CUDA tensors here; move the inputs to the GPU, use kernels='torch', "
                    "or start Python with TRITON_INTERPRET=1 to run them in Triton's interpreter on CPU")
        if device.type == "cuda":
            return ("Triton runs in interpreter mode (TRITON_INTERPRET=1), which takes CPU tensors; unset "
                    "TRITON_INTERPRET for CUDA kernels, or use kernels='torch'")
        return f"Triton kernels do not run on {device.type} tensors; use kernels='torch'"


_STATUS: list[TritonStatus] = []


def prepare() -> None:
    """Choose interpreter mode before Triton loads: on, where there is no CUDA and the user did not say."""
    if "TRITON_INTERPRET" in os.environ or "triton" in sys.modules:
        return
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def status() -> TritonStatus:
    """Load Triton once and report whether our kernels can run (never raises)."""
    if _STATUS:
        return _STATUS[0]
    prepare()
    interpret = interpreting()
    try:
        triton = importlib.import_module("triton")
        importlib.import_module("triton.language")
    except ImportError as e:
        st = TritonStatus(False, interpret, None,
                          f"Triton is not installed ({e.__class__.__name__}: {e}); `pip install triton` "
                          "or use kernels='torch'")
    else:
        version = getattr(triton, "__version__", "?")
        why = None
        if not interpret and not torch.cuda.is_available():
            why = ("Triton was loaded without TRITON_INTERPRET=1 on a machine without CUDA, so its kernels can "
                   "neither compile nor be interpreted; import workbench before torch.compile/triton, or start "
                   "Python with TRITON_INTERPRET=1; or use kernels='torch'")
        st = TritonStatus(why is None, interpret, version, why)
    _STATUS.append(st)
    return st
