"""A rank that never joins the process group: the ranks that did get one line, not a store key."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

SCRIPT = """
import os
from workbench.train.group import init_group
try:
    init_group(False)
except RuntimeError as e:
    print(e)
"""


@pytest.mark.timeout(60)
def test_a_rank_that_never_joins_is_one_line_naming_the_timeout_and_the_fix():
    with socket.socket() as s:  # a free port for the store rank 0 hosts
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "2",
           "WORKBENCH_PG_TIMEOUT_S": "1"}
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=50,
                       env={**os.environ, **env})
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1, p.stdout + p.stderr[-2000:]
    assert lines[0].startswith("the process group of 2 ranks did not form within 1 s: another rank never joined")
    assert lines[0].endswith("raise WORKBENCH_PG_TIMEOUT_S")
