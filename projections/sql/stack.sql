-- Named queries of the local stack (`tapeline/stack/postgres.py`). The `psql_*` ones are lines of a
-- psql script run as the postgres OS user: `:'name'` are psql variables set by `\set` lines before
-- them, and `\gexec` runs the statement the SELECT produced (none when the role or database exists).

-- name: ping
-- Whether the server answers a query.
SELECT 1;

-- name: drop_database_force
-- Drop database {database} if it exists, ending its sessions (refused to a non-superuser while an autovacuum worker is in it, PostgreSQL 15 and 16).
DROP DATABASE IF EXISTS {database} WITH (FORCE);

-- name: drop_database
-- Drop database {database} if it exists (waits up to 5 seconds for its other sessions to end).
DROP DATABASE IF EXISTS {database};

-- name: can_create_database
-- Whether the current role may CREATE DATABASE.
SELECT rolcreatedb OR rolsuper FROM pg_roles WHERE rolname = current_user;

-- name: psql_create_reader_role
-- psql: create the NOLOGIN role tapeline_reader when it is missing.
SELECT 'CREATE ROLE tapeline_reader NOLOGIN' WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'tapeline_reader') \gexec

-- name: psql_grant_reader_to_login
-- psql: make :'login' a member of tapeline_reader when it is not.
SELECT format('GRANT tapeline_reader TO %I', :'login') WHERE NOT pg_has_role(:'login', 'tapeline_reader', 'MEMBER') \gexec

-- name: psql_create_login_role
-- psql: create the login role :'role' (LOGIN, CREATEDB, password :'pw') when it is missing.
SELECT format('CREATE ROLE %I LOGIN CREATEDB PASSWORD %L', :'role', :'pw') WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = :'role') \gexec

-- name: psql_create_certificate_role
-- psql: create the role :'role' (LOGIN, no password: it logs in by a client certificate) when it is missing.
SELECT format('CREATE ROLE %I LOGIN', :'role') WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = :'role') \gexec

-- name: psql_turn_tls_on
-- psql: turn TLS on with the files :'cert', :'key' and the client CA :'ca' ('' for none), TLS 1.2 at least, then reload (no restart: sessions stay).
ALTER SYSTEM SET ssl_cert_file = :'cert';
ALTER SYSTEM SET ssl_key_file = :'key';
ALTER SYSTEM SET ssl_ca_file = :'ca';
ALTER SYSTEM SET ssl_min_protocol_version = 'TLSv1.2';
ALTER SYSTEM SET ssl = on;
SELECT pg_reload_conf();

-- name: psql_create_database
-- psql: create database :'db' owned by :'role' when it is missing.
SELECT format('CREATE DATABASE %I OWNER %I', :'db', :'role') WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = :'db') \gexec

-- name: create_database
-- Create database {database} (a scratch database: tests, scripts/schema_snapshot.py).
CREATE DATABASE {database};
