"""Benchmarks: scripts that print tables of measured ratios."""
