"""Keep a notebook's widgets answering while a cell blocks (``RunDashboard.wait()``).

ipykernel runs one request of the page at a time on its main thread. While a cell blocks, a click on a
widget (a ``comm_msg``) waits behind it, and under Run All behind every later cell's ``execute_request``
too: the Stop button does nothing until the run has ended by itself (issue 28). :class:`CommPump`,
used only from inside such a blocking call, takes the page's pending requests off the kernel's queue:

    with CommPump.here() or contextlib.nullcontext() as pump:
        while not done():
            if pump: pump.pump(0.1)   # handles widget messages now; keeps the rest, in order
            else: time.sleep(0.1)

Widget messages (``comm_open``, ``comm_msg``, ``comm_close``) are handled at once, by the kernel's own
handlers, as ipykernel 7 itself does while an async cell awaits. Everything else (the next cells, a
completion request) is held, and handed back to the kernel in its original order when the pump closes,
so it runs after the blocking cell exactly as it would have.

This reaches into ipykernel's internals (the inproc socket that feeds the main thread, ipykernel >= 7's
shell channel thread), so :meth:`CommPump.here` checks every piece it uses and returns None where one is
missing: an older or a future ipykernel, a thread other than the kernel's main thread, or no kernel at
all (a script). The caller then blocks as before; nothing else changes.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from typing import Any

WIDGET_MSG_TYPES = frozenset({"comm_open", "comm_msg", "comm_close"})

_active = threading.local()  # one pump at a time: a nested blocking call reuses nothing, it just blocks


class CommPump:
    """Handles the page's widget messages while the kernel's main thread is blocked in a cell."""

    def __init__(self, kernel: Any, socket: Any, reply_socket: Any, recv: Any):
        self._kernel, self._socket, self._reply_socket, self._recv = kernel, socket, reply_socket, recv
        self._held: list[list[Any]] = []  # frames of the requests that wait for the cell, in arrival order
        self.handled = 0  # widget messages handled so far

    @classmethod
    def here(cls) -> "CommPump | None":
        """A pump for the cell running on this thread, or None where there is none to be had (see above)."""
        if getattr(_active, "pump", None) is not None or threading.current_thread() is not threading.main_thread():
            return None
        if "ipykernel" not in sys.modules:  # a script or a terminal: no kernel, nothing queues behind us
            return None
        try:
            import zmq
            from IPython import get_ipython

            kernel = getattr(get_ipython(), "kernel", None)
            manager = kernel.shell_channel_thread.manager
            pair = manager.get_shell_channel_to_subshell_pair(None)
            socket = pair.to_socket
            # What the kernel's own reader calls with each request it reads: held requests go back through it,
            # so they take the same path, in the same order, as the one it read before the cell blocked.
            recv = pair.to_stream._recv_callback
            if not callable(recv):
                return None
            reply_socket = manager.get_subshell_to_shell_channel_socket(None)
            handlers = kernel.shell_handlers
            if not all(callable(handlers.get(t)) for t in WIDGET_MSG_TYPES):
                return None
            kernel.get_parent("shell"), kernel._parent_ident["shell"]  # what _handle saves and restores
            if not isinstance(socket, zmq.Socket):
                return None
            asyncio.get_running_loop()  # the kernel's loop runs this cell: held requests are scheduled on it
        except (AttributeError, ImportError, KeyError, RuntimeError, TypeError):
            return None
        return cls(kernel, socket, reply_socket, recv)

    def __enter__(self) -> "CommPump":
        _active.pump = self
        return self

    def __exit__(self, *exc: Any) -> None:
        _active.pump = None
        self.close()

    def pump(self, timeout: float = 0.0) -> int:
        """Wait up to ``timeout`` seconds for the page's requests, then take every one queued: handle the
        widget messages, hold the rest. Returns how many widget messages were handled."""
        import zmq

        handled = 0
        if self._socket.poll(max(0, int(timeout * 1000)), zmq.POLLIN) == 0:
            return 0
        while True:
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return handled
            # A widget message overtakes the held requests (that is the point: a click on Stop must not
            # wait for the cells queued behind this one); the held ones keep their order among themselves.
            if self._handle(frames):
                handled += 1
            else:
                self._held.append(frames)

    def _handle(self, frames: list[Any]) -> bool:
        """Handle ``frames`` if they are a widget message (True); False leaves them for the caller to hold."""
        kernel = self._kernel
        session = kernel.session
        try:
            idents, rest = session.feed_identities(frames, copy=False)
            # Peek at the header only: a full deserialize records the signature, and the kernel would later
            # refuse a held message as a replay.
            msg_type = session.deserialize(rest, content=False, copy=False)["header"]["msg_type"]
            if msg_type not in WIDGET_MSG_TYPES:
                return False
            msg = session.deserialize(rest, content=True, copy=False)
        except Exception:  # ipykernel's one-frame "stop aborting" marker, or anything else: the kernel's own
            return False
        parent, parent_ident = kernel.get_parent("shell"), kernel._parent_ident["shell"]
        kernel.set_parent(idents, msg, channel="shell")  # what the handler prints or sends answers this message
        try:
            kernel.shell_handlers[msg_type](self._reply_socket, idents, msg)
        except Exception:  # as the kernel does: a widget callback's error is logged, the cell goes on
            kernel.log.error("Exception in %s handler (handled while a cell waited):", msg_type, exc_info=True)
        finally:
            for stream in (sys.stdout, sys.stderr):
                if stream is not None:
                    stream.flush()
            kernel.set_parent(parent_ident, parent, channel="shell")
        self.handled += 1
        return True

    def close(self) -> None:
        """Hand the held requests back to the kernel, in their order, behind any it had already read.

        The kernel's reader takes the next request off the socket before a cell starts (so the pump never
        sees it) and hands it on through its receive callback, a task that schedules the handler. Going
        back through that same callback keeps the held requests behind it: a held request scheduled any
        faster overtakes it, runs first (a NameError where it uses what that cell defines) and, failing,
        aborts it."""
        held, self._held = self._held, []
        for frames in held:
            asyncio.ensure_future(self._recv(frames))


__all__ = ["CommPump", "WIDGET_MSG_TYPES"]
