"""Intake producers: `tapeline submit` (and, later, the HTTP upload API)."""
