#!/bin/sh
# The official postgres image's start, in short: on an empty data folder, initdb with
# POSTGRES_USER and POSTGRES_PASSWORD (password auth over TCP), create POSTGRES_DB; then run
# PostgreSQL as PID 1, as the postgres user.
set -eu
: "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD must be set}"
user=${POSTGRES_USER:-postgres}
db=${POSTGRES_DB:-$user}
mkdir -p "$PGDATA"
chown postgres:postgres "$PGDATA"
chmod 700 "$PGDATA"
as_postgres() { setpriv --reuid=postgres --regid=postgres --init-groups "$@"; }
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pwfile=$(mktemp) && printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile" && chown postgres "$pwfile"
  as_postgres initdb -D "$PGDATA" -U "$user" --pwfile="$pwfile" --auth-local=trust \
    --auth-host=scram-sha-256 > /dev/null
  rm -f "$pwfile"
  echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
  echo "listen_addresses = '*'" >> "$PGDATA/postgresql.conf"
  if [ "$db" != postgres ]; then
    as_postgres pg_ctl -D "$PGDATA" -w -s -o "-c listen_addresses=''" start
    as_postgres psql -q -v ON_ERROR_STOP=1 -U "$user" -d postgres \
      -c "CREATE DATABASE \"$db\" OWNER \"$user\""
    as_postgres pg_ctl -D "$PGDATA" -w -s -m fast stop
  fi
  echo "entrypoint: initialised $PGDATA (user $user, database $db)"
fi
if [ "$1" = postgres ]; then
  exec setpriv --reuid=postgres --regid=postgres --init-groups "$@" -D "$PGDATA"
fi
exec "$@"
