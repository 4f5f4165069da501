"""Imported by the fork server alone (the last module it preloads, see fork_start.py): it exits at
once when its worker has gone, instead of tearing down the torch and transformers it loaded.

The fork server only forks trial processes (each of which ends with os._exit, never through
here): at its exit there is nothing to flush or close, and the interpreter's teardown of those
libraries costs a second or two of CPU, during which it holds the worker's stdout and stderr
open, so whoever reads them (a pipe, `tee`, a test) waits for it.
"""

from __future__ import annotations

import atexit
import os


def _exit_at_once() -> None:
    os._exit(0)


atexit.register(_exit_at_once)
