"""Projections: the lifecycle log folded into PostgreSQL (state, evidence, stall views), and reads."""
