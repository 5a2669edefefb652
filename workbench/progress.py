"""Progress bars: ``tqdm.auto``, except that a notebook bar that goes away leaves nothing behind.

tqdm's notebook bar with ``leave=False`` *closes* its widget when done. The cell's output still names
that widget, so the saved notebook, reopened or reloaded, shows "Error displaying widget: model not
found" where the bar was (issue 28). Here such a bar is displayed under a display id, and when it closes
its output is replaced by nothing. Bars kept (``leave=True``) and bars that stopped on an error stay as
tqdm leaves them. Outside a notebook this is ``tqdm.auto.tqdm`` itself.

    from workbench.progress import tqdm   # instead of: from tqdm.auto import tqdm
"""

from __future__ import annotations

from typing import Any

from tqdm.auto import tqdm as _auto

__all__ = ["tqdm"]

# tqdm.auto picked its notebook bar only inside a kernel with ipywidgets; only then is there anything to
# fix, and only then is tqdm.notebook (ipywidgets, IPython) imported: a script or a rank imports no view module.
if any(c.__module__ == "tqdm.notebook" for c in _auto.__mro__):

    class tqdm(_auto):  # type: ignore[no-redef]  # noqa: N801 - tqdm's own name, a drop-in
        def __init__(self, *args: Any, **kwargs: Any):
            self._handle = None
            show = kwargs.pop("display", True)
            kwargs["display"] = False  # displayed below, under a display id we can empty later
            super().__init__(*args, **kwargs)
            if show and not self.disable and self.delay <= 0:
                from IPython.display import display

                self._handle = display(self.container, display_id=True)
                self.displayed = True

        def close(self) -> None:
            if self.disable:
                return
            failed = bool(self.total and self.n < self.total)
            super().close()
            if self._handle is not None and not self.leave and not failed:
                self._handle.update({"text/plain": ""}, raw=True)
                self._handle = None
else:
    tqdm = _auto  # type: ignore[misc]
