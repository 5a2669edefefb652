"""Small helpers shared by the tests that follow real processes."""

from __future__ import annotations

import time


def wait_for(pred, timeout: float = 60.0):
    """Poll ``pred`` every 50 ms until it returns something truthy (returned), or raise TimeoutError."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError("condition not met")
