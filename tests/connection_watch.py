"""Samples the connections a PostgreSQL server holds on one database, for the tests and
bench/many_workers.py.
"""

from __future__ import annotations

import threading

import sqlalchemy as sa


class ConnectionWatch:
    """Samples the server connections on one database (all but its own: hpo's, or PgBouncer's
    on their behalf): the most at once, and the most of one hpo process (application_name
    'hpo <pid>'; through PgBouncer a server connection carries its latest client's name),
    sampled every `every_s` while the block runs."""

    def __init__(self, url: str, every_s: float = 0.05) -> None:
        self.every_s = every_s
        self.engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
        self.database = sa.engine.make_url(url).database
        self.total = self.per_process = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ConnectionWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.engine.dispose()

    def _run(self) -> None:
        query = sa.text(
            "SELECT application_name, count(*) FROM pg_stat_activity "
            "WHERE datname = :db AND pid <> pg_backend_pid() GROUP BY application_name"
        )
        with self.engine.connect() as conn:  # one connection for the whole watch
            while not self._done.wait(self.every_s):
                counts: dict[str, int] = dict(conn.execute(query, {"db": self.database}).all())
                conn.rollback()  # a fresh snapshot of pg_stat_activity each time
                self.total = max(self.total, sum(counts.values()))
                hpo = [n for name, n in counts.items() if str(name).startswith("hpo ")]
                self.per_process = max([self.per_process, *hpo])
