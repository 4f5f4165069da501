"""`python -m hpo` and the `hpo` command. A Ctrl-C or SIGTERM while the CLI itself loads (torch
and transformers take seconds) ends it quietly: the CLI installs its own handling once loaded."""

from __future__ import annotations

import signal
import sys
from types import FrameType

from hpo.stopping import Interrupted, stopped_exit_code  # light: the standard library only


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signal.Signals(signum).name)


def entry() -> int:
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        from hpo.cli.app import main
    except KeyboardInterrupt as e:
        name = getattr(e, "signal_name", "SIGINT")
        print(f"hpo: stopped by {name} while starting", file=sys.stderr)
        return stopped_exit_code(name)
    return main()


if __name__ == "__main__":
    raise SystemExit(entry())
