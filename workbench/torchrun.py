"""The module entry for plain ``torchrun``: ``workbench train``'s flags, one rank per process::

    torchrun --nproc-per-node 2 -m workbench.torchrun tiny --tp 2 --steps 20 --out runs/a

Rank 0 owns the run directory and the other ranks join it (``workbench.train.torchrun_rank``, which says
how). This module only parses the command line, with ``workbench train``'s own parser: the same flags,
help and one-line usage errors. It sits beside ``workbench.cli`` rather than in ``workbench.train``, as
the train package is below the command line and never imports it.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys

PROG = "torchrun [torchrun options] -m workbench.torchrun"


def train_parser():
    """``workbench train``'s parser, named for torchrun."""
    from workbench.cli import _Parser, _add_train

    sub = _Parser(prog=PROG).add_subparsers(dest="command", parser_class=_Parser)
    _add_train(sub)
    parser = sub.choices["train"]
    parser.prog = PROG
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from workbench.cli import _Parser, _default_out
    from workbench.train.torchrun_rank import run_args

    _Parser.json_requested = "--json" in argv
    # Every rank parses the same command line: each machine's local rank 0 reports a usage error (--help too).
    quiet = os.environ.get("LOCAL_RANK", "0") != "0"
    sink = io.StringIO()
    with (contextlib.redirect_stderr(sink) if quiet else contextlib.nullcontext()), \
            (contextlib.redirect_stdout(sink) if quiet else contextlib.nullcontext()):
        args = train_parser().parse_args(argv)
    return run_args(args, default_out=lambda: _default_out(None))


if __name__ == "__main__":
    from workbench.lifeline import exit_now

    exit_now(main())  # no teardown: gloo's thread objects can abort a rank that finished (workbench.lifeline)
