"""Atomic JSON files (a shared leaf module): what a user saved is never left half-written.

``write_json_atomic`` writes a temporary file beside the target, fsyncs it and renames it over
the target, so a reader (or a crash) sees the old file or the new one, never a mix.
``read_json`` turns a missing or unparsable file into the caller's fxpipe error class.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fxpipe.errors import FxpipeError


def write_json_atomic(path: str | os.PathLike[str], obj: Any) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_json(path: str | os.PathLike[str], error: type[FxpipeError], what: str, hint: str) -> Any:
    """Parse ``path``; a missing or malformed file raises ``error`` naming the path."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise error(f"{what} file {str(path)!r} does not exist", hint) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{str(path)!r} is not valid JSON: {e}", hint) from None
