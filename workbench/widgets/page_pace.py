"""``PagePace``: an invisible widget that tells the kernel when the page has drawn what it was sent.

A live view can send redraws faster than a browser draws them: the dashboard's seven plotly figures took
0.6-1.7 s to redraw in Chromium on a loaded 2-core machine (the "page round trip" that
tests/views/test_dashboard_browser.py prints under ``pytest -s``). Sent four times a second, they keep the
page's main thread busy for good, so a click on Stop waits there for seconds before it even reaches the
kernel (issue 28). The kernel cannot see the page's clock, so the page says: after each redraw the view
bumps ``tick``, and every rendering of this widget echoes the tick once the frames that draw the figures
(queued before the tick arrived) and PlotView's draw queue are done. The view sends its next redraw only once the page has echoed and then had as long
again to itself, so the page spends at most about half its time drawing it and stays free for clicks:

    pace = PagePace()                    # in the view's widget tree; it shows nothing
    if pace.ready(wait_s=2.0):           # the page has drawn the last redraw and rested (or no page echoes)
        ... redraw ...
        pace.sent()

Where no page shows it (a script, nbclient, a closed tab) nothing echoes, and ``ready`` is always True.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import anywidget
import traitlets

__all__ = ["PagePace"]


class PagePace(anywidget.AnyWidget):
    _esm = """
    export default {
      render({ model, el }) {
        el.style.display = 'none';
        // Two frames (the one that draws what came before this tick, then the next), and then until
        // PlotView's page-wide draw queue has drawn every figure queued before.
        const echo = () => {
          const tick = model.get('tick');
          const send = () => model.send({ drawn: tick });
          requestAnimationFrame(() => requestAnimationFrame(() => {
            const q = window.__parallelWorkbenchDrawQueue;
            q ? q.whenIdle(send) : send();
          }));
        };
        model.on('change:tick', echo);
        return () => model.off('change:tick', echo);
      },
    };
    """
    tick = traitlets.Int(0).tag(sync=True)

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self._lock = threading.Lock()
        self._sent = (0, 0.0)  # the last tick sent, and when (monotonic)
        self._drawn_at: float | None = None  # when a page echoed it
        self._page = False  # a page echoes: it has, and has not since stayed silent for a whole wait
        self.on_msg(self._on_echo)

    def _on_echo(self, _widget: Any, content: Any, _buffers: Any) -> None:
        drawn = content.get("drawn") if isinstance(content, dict) else None
        if isinstance(drawn, int) and not isinstance(drawn, bool):
            with self._lock:
                self._page = True
                if drawn >= self._sent[0] and self._drawn_at is None:
                    self._drawn_at = time.monotonic()

    def sent(self) -> None:
        """Mark a redraw as sent (after it): the page echoes it once drawn."""
        with self._lock:
            self.tick += 1
            self._sent, self._drawn_at = (self.tick, time.monotonic()), None

    def ready(self, wait_s: float) -> bool:
        """Whether to send the next redraw now: the page has drawn the last one and has had as long again
        to itself, so it spends at most half its time on them. True where no page echoes; a page that has
        not echoed within ``wait_s`` counts as gone until it echoes again."""
        with self._lock:
            tick, at = self._sent
            if not self._page or tick == 0:
                return True
            now = time.monotonic()
            if self._drawn_at is None:
                if now - at > wait_s:
                    self._page = False
                    return True
                return False
            return now >= self._drawn_at + (self._drawn_at - at)
