"""PgBouncer in front of the test server, started from the shipped deploy/pgbouncer/pgbouncer.ini
with only its port, pool size, user list and files changed: for the tests and bench/many_workers.py.
"""

from __future__ import annotations

import configparser
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import sqlalchemy as sa

SHIPPED_INI = Path(__file__).resolve().parents[1] / "deploy" / "pgbouncer" / "pgbouncer.ini"


def pgbouncer_binary() -> str | None:
    return shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if Path(p).is_file()), None
    )


@contextmanager
def pgbouncer(server_url: str, pool_size: int) -> Iterator[str]:
    """Runs PgBouncer (session mode, `pool_size` server connections) in front of the server of
    `server_url`; yields the URL of the same database through it."""
    binary = pgbouncer_binary()
    if binary is None:
        raise FileNotFoundError("pgbouncer is not installed (apt-get install pgbouncer)")
    url = sa.engine.make_url(server_url)
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="hpo-pgbouncer-") as folder:
        ini = _config(Path(folder), url, port, pool_size)
        command = [binary, str(ini)]
        if os.geteuid() == 0:  # PgBouncer refuses to run as root
            user = pwd.getpwnam("postgres")
            os.chown(folder, user.pw_uid, user.pw_gid)
            command[1:1] = ["-u", "postgres"]
        # Its log goes to the file only (-q): a pipe nobody reads would fill and stall it.
        command.insert(1, "-q")
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_listening(port, process, Path(folder) / "pgbouncer.log")
            yield url.set(port=port).render_as_string(hide_password=False)
        finally:
            process.terminate()
            process.wait(timeout=30)


def _config(folder: Path, url: sa.engine.URL, port: int, pool_size: int) -> Path:
    parser = configparser.ConfigParser(delimiters=("=",), comment_prefixes=(";",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys keep their case
    parser.read(SHIPPED_INI, encoding="utf-8")
    parser["databases"]["*"] = f"host={url.host or '127.0.0.1'} port={url.port or 5432}"
    settings = parser["pgbouncer"]
    settings["listen_port"] = str(port)
    settings["default_pool_size"] = str(pool_size)
    settings["auth_file"] = str(folder / "userlist.txt")
    settings["logfile"] = str(folder / "pgbouncer.log")
    settings["pidfile"] = str(folder / "pgbouncer.pid")
    # Thousands of short sessions: a line each would only fill the disk.
    settings["log_connections"] = settings["log_disconnections"] = "0"
    (folder / "userlist.txt").write_text(f'"{url.username or "postgres"}" ""\n', encoding="utf-8")
    ini = folder / "pgbouncer.ini"
    with ini.open("w", encoding="utf-8") as handle:
        parser.write(handle)
    return ini


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _wait_listening(port: int, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if process.poll() is not None:
            error = log.read_text(errors="replace") if log.is_file() else ""
            raise RuntimeError(f"pgbouncer exited {process.returncode}: {error.strip()[-500:]}")
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"pgbouncer did not listen on 127.0.0.1:{port} within 20 s")
