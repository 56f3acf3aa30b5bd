"""Experiment configs: ``base.py`` declares every key once; other files derive from it."""
