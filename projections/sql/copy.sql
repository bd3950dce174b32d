-- Named COPY templates of the bulk writes (`projections/writes.py`). {table} is the table and
-- {columns} its column list (`tapeline.postgres.identifiers`), both quoted identifiers filled by
-- `tapeline.postgres.qf`; the rows follow on STDIN. One template per combination of options, so
-- no statement text is assembled in Python.

-- name: copy_text
-- Rows in text COPY format into {table} ({columns}).
COPY {table} ({columns}) FROM STDIN;

-- name: copy_text_freeze
-- Rows in text COPY format into {table} ({columns}), frozen (the table was created or truncated in this transaction).
COPY {table} ({columns}) FROM STDIN (FREEZE);

-- name: copy_binary
-- Rows in binary COPY format into {table} ({columns}).
COPY {table} ({columns}) FROM STDIN (FORMAT binary);

-- name: copy_binary_freeze
-- Rows in binary COPY format into {table} ({columns}), frozen (the table was created or truncated in this transaction).
COPY {table} ({columns}) FROM STDIN (FORMAT binary, FREEZE);
