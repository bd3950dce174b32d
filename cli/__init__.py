"""The roof: the `tapeline` command and what it starts.

`main` builds the command line from the command modules (`run_command`, `job_commands`,
`operator_commands`, `webhook_commands`, `region_commands`, `history_commands`) and the plug-in
groups other packages register (the dev stack's `stack`); `helpers` is what they share; `wiring` is
the one place that builds the adapters behind the ports and hands them to the processors, the
projector and the web app; `supervisor` runs `tapeline run --role all` as child processes. Nothing
below this package imports it.
"""
