"""The entry points (`python -m experiments.<command>`).

Importing this package installs `one_line_interrupt`: a Ctrl-C that lands while a command is still importing its
modules (torch, MLflow: the first seconds), before `run_cli` can catch it, prints one line instead of a 15-20 line
KeyboardInterrupt traceback. The process still ends by SIGINT, as Python ends on an uncaught Ctrl-C (status 130 in
a shell).
"""
from __future__ import annotations

import sys


def one_line_interrupt(kind, value, tb) -> None:
    """`sys.excepthook` for the entry points: an uncaught KeyboardInterrupt is one line; the rest as before."""
    if issubclass(kind, KeyboardInterrupt):
        print("stopped by SIGINT while starting (nothing was done)", file=sys.stderr)
        return
    sys.__excepthook__(kind, value, tb)


if sys.excepthook is sys.__excepthook__:  # a hook someone else set (an IDE, a debugger) stays
    sys.excepthook = one_line_interrupt
