"""Mutation testing: ``python -m tools.mutation`` (from the repository root); see ``run.py``."""
