"""Why each argued survivor of ``python -m tools.mutation`` is equivalent: the table is data,
``equivalent.json`` next to this file (its ``about`` says what each part means); this module
only loads it.

An argument is keyed by (module, stripped original line, mutated line), so a rerun after a code
change shows which arguments no longer apply (the report marks a survivor without one as a
missing test); ``equivalent_at`` adds the line number, for a line whose text repeats in the
module with another meaning. An entry's ``why`` is its argument, or its ``shared`` names one of
the ``shared`` arguments (used by several entries).
"""
from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).with_name("equivalent.json")

Key = tuple[str, str, str]          # (module, stripped line, mutated line)
KeyAt = tuple[str, int, str, str]   # (module, line number, stripped line, mutated line)


def load(path: Path = DATA) -> tuple[dict[Key, str], dict[KeyAt, str], dict[Key, str]]:
    """(EQUIVALENT, EQUIVALENT_AT, KILLED_SINCE): key -> argument, and key -> the test that kills
    a survivor of the saved run since (applied by hand, not rerun yet)."""
    d = json.loads(path.read_text())
    shared: dict[str, str] = d["shared"]

    def why(e: dict) -> str:
        if ("why" in e) == ("shared" in e):
            raise ValueError(f"{path}: {e} needs exactly one of 'why' and 'shared'")
        if "why" in e:
            return e["why"]
        if e["shared"] not in shared:
            raise ValueError(f"{path}: {e} names no shared argument")
        return shared[e["shared"]]

    def table(name: str, fields: tuple[str, ...], value) -> dict:
        out: dict = {}
        for e in d[name]:
            key = tuple(e[f] for f in fields)
            if key in out:
                raise ValueError(f"{path}: {name} has {key} twice")
            out[key] = value(e)
        return out

    return (table("equivalent", ("module", "line", "mutant"), why),
            table("equivalent_at", ("module", "line_number", "line", "mutant"), why),
            table("killed_since", ("module", "line", "mutant"), lambda e: e["test"]))


EQUIVALENT, EQUIVALENT_AT, KILLED_SINCE = load()
