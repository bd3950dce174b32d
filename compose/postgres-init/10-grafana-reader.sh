#!/bin/sh
# Runs once, when the postgres container initialises its data directory: the read-only role the
# projections are granted to (migration 010 grants SELECT on every table and view to it) and a
# login role for Grafana that is a member of it and of nothing else.
set -eu
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
     -v grafana_password="${TAPELINE_GRAFANA_DB_PASSWORD:-grafana}" <<'SQL'
SELECT 'CREATE ROLE tapeline_reader NOLOGIN'
WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'tapeline_reader') \gexec
SELECT format('CREATE ROLE grafana LOGIN PASSWORD %L IN ROLE tapeline_reader', :'grafana_password')
WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'grafana') \gexec
SQL
