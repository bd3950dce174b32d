"""Pure policies: each takes its inputs and `now` and returns a decision (no I/O, no clock reads)."""
