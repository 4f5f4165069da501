"""`python -m hpo` and the `hpo` command. A Ctrl-C or SIGTERM while the CLI itself loads (torch
and transformers take seconds) ends it quietly: the CLI installs its own handling once loaded."""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
from types import FrameType

# light: the standard library only
from hpo.stopping import Interrupted, inside_import, stopped_exit_code

# The exit code main() returned; None until it returns (an uncaught error exits as usual).
_exit_code: list[int] = []
# A stop signal that came while the CLI's modules loaded (never raised there: inside_import).
_stopped_while_loading: list[str] = []


def _interrupt(signum: int, frame: FrameType | None) -> None:
    name = signal.Signals(signum).name
    if inside_import(frame):
        _stopped_while_loading.append(name)
        return
    raise Interrupted(name)


def entry() -> int:
    # Registered first, so it runs last: after every other exit handler of the command.
    atexit.register(_exit_without_teardown)
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        from hpo.cli.app import main
    except KeyboardInterrupt as e:
        _stopped_while_loading.append(getattr(e, "signal_name", "SIGINT"))
    if _stopped_while_loading:
        name = _stopped_while_loading[0]
        print(f"hpo: stopped by {name} while starting", file=sys.stderr)
        return stopped_exit_code(name)
    code = main(own_process=True)
    _exit_code.append(code)
    return code


def _exit_without_teardown() -> None:
    """Once the command has returned and every exit handler has run (threads joined, temporary
    files removed, trial processes ended), exit at once. The interpreter's own teardown of
    torch, transformers and SQLAlchemy takes a second or two of CPU and does nothing a user
    sees: the database connections close with the process. Logs and output are flushed
    first; if that fails (a closed pipe), the interpreter exits as usual and reports it."""
    if not _exit_code:
        return
    logging.shutdown()
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:  # None: started with that descriptor closed (`>&-`)
                stream.flush()
    except (OSError, ValueError):
        return
    os._exit(_exit_code[0])


if __name__ == "__main__":
    raise SystemExit(entry())
