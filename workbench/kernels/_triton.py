"""The one place that loads Triton, and decides whether its kernels compile for CUDA or run in its
interpreter.

Where there is no CUDA, our Triton kernels run on CPU tensors in Triton's interpreter
(``TRITON_INTERPRET=1``), which is how CI checks them. :func:`prepare` sets ``TRITON_INTERPRET=1`` in this
process's environment, unless the user set it either way, Triton is not installed, CUDA is available (the
kernels compile for the GPU) or Triton is already loaded. ``import workbench`` does not call it: importing
``workbench.kernels`` does (the package that defines our ops, so before a model that uses them is built
or compiled), and so does :func:`status`, the first time our kernels load Triton.

Why the whole process, and not only around our kernels (checked with Triton 3.6):

* ``@triton.jit`` picks interpreter or compiler when a function is *decorated*, reading
  ``TRITON_INTERPRET`` then. Triton's own helpers that our kernels call (``tl.sum``, ``tl.cumsum``,
  ``tl.cdiv``, ``tl.randint``) are decorated when ``triton.language`` is first imported, by anyone: an
  interpreted kernel cannot call a compiled helper ("Cannot call @triton.jit'd outside of the scope of a
  kernel"). So the variable must be set before Triton is first imported in the process, and
  ``torch.compile`` imports it even on CPU.
* Triton reads it again while an interpreted kernel launches: its first launch imports
  ``triton.experimental.gluon``, which asserts that the interpreter is on. So it cannot be unset once the
  imports are done.

Setting it only without CUDA keeps GPU machines untouched; on a machine without CUDA nothing else in the
process can use Triton's compiler anyway. Child processes (torchrun ranks) inherit it, and make the same
choice themselves.

:func:`status` answers, without raising, whether Triton kernels can run here and on which device.
"""

from __future__ import annotations

import importlib
import importlib.util
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
    """Choose interpreter mode before Triton loads: on, where there is no CUDA and the user did not say.

    Process-wide, for the reasons in the module docstring; called when ``workbench.kernels`` is imported.
    """
    if "TRITON_INTERPRET" in os.environ or "triton" in sys.modules or importlib.util.find_spec("triton") is None:
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
                   "neither compile nor be interpreted; import workbench.kernels before torch.compile/triton, or "
                   "start Python with TRITON_INTERPRET=1; or use kernels='torch'")
        st = TritonStatus(why is None, interpret, version, why)
    _STATUS.append(st)
    return st
