"""Docs figures kept true: regenerate what the pages show a deterministic command printing."""
