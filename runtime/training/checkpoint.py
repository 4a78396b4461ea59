"""Pipeline checkpoints: one file per stage, a manifest per checkpoint, atomic writes.

``DIR/e{epoch:04d}-m{minibatch:07d}/stage{s}.pt`` and ``manifest.json``, written by rank 0 once
every stage's file exists; the position is the NEXT minibatch to train. Each process writes only
its own stage, resume skips incomplete checkpoints, and loading is ``weights_only``."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from fxpipe.errors import FxpipeError

log = logging.getLogger(__name__)

FORMAT = 1
_NAME = re.compile(r"^e(\d{4,})-m(\d{7,})$")


class CheckpointError(FxpipeError):
    """No usable checkpoint, a corrupt one, or one made for a different pipeline."""


KEEP = 3
"""Complete checkpoints the trainer keeps by default (``keep_checkpoints``): the newest three,
so a corrupt last one still leaves two to fall back to."""


def check_directory(directory: str | os.PathLike[str]) -> None:
    """Refuse, before training, a ``checkpoint_dir`` the first checkpoint could not be written
    to: a file, a path through a file, or a directory (or the nearest existing parent of one
    to be made) this process cannot write."""
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"checkpoint_dir={str(directory)!r} is a file, not a directory",
                              "pass a directory (made if missing), e.g. checkpoint_dir='ckpt/'")
    there = path
    while not there.exists():
        there = there.parent
    if not there.is_dir():
        raise CheckpointError(f"checkpoint_dir={str(directory)!r} cannot be made: {there} is a "
                              "file", "pass a directory path that does not go through a file")
    if not os.access(there, os.W_OK | os.X_OK):
        raise CheckpointError(f"checkpoint_dir={str(directory)!r}: this process cannot write "
                              f"to {there}", "pass a directory you can write to")


def existing_run(directory: str | os.PathLike[str]) -> str | None:
    """What ``directory`` already holds from a run (the newest checkpoint's name, position and
    how many there are), or None when it holds no checkpoint folder."""
    root = Path(directory)
    names = sorted(p.name for p in root.iterdir()
                   if _NAME.match(p.name) and p.is_dir()) if root.is_dir() else []
    if not names:
        return None
    m = _NAME.match(names[-1])
    assert m is not None
    return (f"{len(names)} checkpoint(s), the newest {names[-1]} (epoch {int(m.group(1))}, "
            f"minibatch {int(m.group(2))})")


def clear(directory: str | os.PathLike[str]) -> None:
    """Delete every checkpoint folder in ``directory`` (nothing else in it)."""
    root = Path(directory)
    for p in root.iterdir() if root.is_dir() else []:
        if _NAME.match(p.name) and p.is_dir():
            shutil.rmtree(p)


def checkpoint_name(epoch: int, minibatch: int) -> str:
    return f"e{epoch:04d}-m{minibatch:07d}"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems do not allow opening directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[Any], None]) -> None:
    """Write ``path`` through ``write(file)`` into a temporary file in the same folder, fsync,
    rename over ``path``: readers see the old file or the complete new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def replica_file(stage: int, replica: int) -> str:
    """The file of replica ``replica`` > 0's own state (LocalSGD: each replica's optimizer)."""
    return f"stage{stage}-replica{replica}.pt"


def save_stage(directory: str | os.PathLike[str], epoch: int, minibatch: int, stage: int,
               state: dict[str, Any], replica: int = 0) -> Path:
    """Write stage ``stage``'s state (weights, buffers, optimizer, ...) of checkpoint
    ``(epoch, minibatch)`` atomically; returns its path. ``replica`` > 0: that replica's own
    state, beside the stage's (:func:`replica_file`)."""
    name = f"stage{stage}.pt" if replica == 0 else replica_file(stage, replica)
    path = Path(directory) / checkpoint_name(epoch, minibatch) / name
    atomic_write(path, lambda f: torch.save({"format": FORMAT, "stage": stage,
                                             "replica": replica, **state}, f))
    log.info("checkpoint %s: %s written", path.parent.name, name)
    return path


def write_manifest(directory: str | os.PathLike[str], epoch: int, minibatch: int,
                   num_stages: int, info: dict[str, Any],
                   replicas: Sequence[int] = ()) -> Path:
    """Record that every stage of checkpoint ``(epoch, minibatch)`` finished (call after all
    stage files exist, e.g. after a barrier). ``info``: JSON-able extras (history, plan...).
    ``replicas``: per stage, how many replicas saved their own state too (LocalSGD)."""
    folder = Path(directory) / checkpoint_name(epoch, minibatch)

    def entry(name: str) -> dict[str, Any]:
        f = folder / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {folder} lacks {f.name}",
                                  "every stage must save before the manifest is written")
        return {"file": f.name, "bytes": f.stat().st_size, "sha256": _sha256(f)}
    stages = {str(s): entry(f"stage{s}.pt") for s in range(num_stages)}
    own = {f"{s}.{j}": entry(replica_file(s, j)) for s, r in enumerate(replicas)
           for j in range(1, r)}
    doc = {"format": FORMAT, "epoch": epoch, "minibatch": minibatch, "num_stages": num_stages,
           "stages": stages, **({"replica_files": own} if own else {}), **info}
    path = folder / "manifest.json"
    atomic_write(path, lambda f: f.write(json.dumps(doc, indent=1, sort_keys=True).encode()))
    log.info("checkpoint %s complete", folder.name)
    return path


@dataclass(frozen=True)
class Found:
    """A complete checkpoint: its folder, position and manifest."""

    folder: Path
    epoch: int
    minibatch: int
    manifest: dict[str, Any]

    def stage_file(self, stage: int) -> Path:
        return self.folder / self.manifest["stages"][str(stage)]["file"]


def check_folder(folder: Path, num_stages: int | None, verify: bool) -> Found:
    """Parse and verify one checkpoint folder, or raise CheckpointError saying what is wrong.
    ``num_stages``: required to match the manifest, or None to take any plan's checkpoint (a
    resume under another plan re-partitions it: :mod:`fxpipe.runtime.training.repartition`)."""
    mpath = folder / "manifest.json"
    if not mpath.is_file():
        raise CheckpointError(f"{folder.name}: no manifest (a stage did not finish)")
    try:
        doc = json.loads(mpath.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{folder.name}: unreadable manifest: {err}") from err
    if num_stages is None and isinstance(doc.get("num_stages"), int):
        num_stages = doc["num_stages"]
    if doc.get("format") != FORMAT or doc.get("num_stages") != num_stages:
        raise CheckpointError(f"{folder.name}: format {doc.get('format')} with "
                              f"{doc.get('num_stages')} stages, expected format {FORMAT} with "
                              f"{num_stages}", "it was made for a different pipeline")
    stages = doc["stages"] if isinstance(doc.get("stages"), dict) else {}
    own = doc.get("replica_files") if isinstance(doc.get("replica_files"), dict) else {}
    for what, entry in [(f"stage {s}'s file", stages.get(str(s))) for s in range(num_stages)] \
            + [(f"replica {k}'s file", e) for k, e in own.items()]:
        f = folder / entry["file"] if entry else None
        if f is None or not f.is_file() or f.stat().st_size != entry["bytes"]:
            raise CheckpointError(f"{folder.name}: {what} is missing or truncated")
        if verify and _sha256(f) != entry["sha256"]:
            raise CheckpointError(f"{folder.name}: {what} does not match its checksum")
    return Found(folder, int(doc["epoch"]), int(doc["minibatch"]), doc)


def find_latest(directory: str | os.PathLike[str], num_stages: int | None, *,
                verify: bool = True) -> Found:
    """The newest checkpoint that every stage finished (older ones when newer are incomplete or
    corrupt); :class:`CheckpointError` listing what was wrong when there is none.
    ``num_stages`` None: a checkpoint of any plan (see :func:`check_folder`)."""
    root = Path(directory)
    folders = []
    if root.is_dir():
        for p in root.iterdir():
            m = _NAME.match(p.name)
            if m and p.is_dir():
                folders.append(((int(m.group(1)), int(m.group(2))), p))
    problems = []
    for _, folder in sorted(folders, reverse=True):
        try:
            found = check_folder(folder, num_stages, verify)
        except CheckpointError as err:
            log.warning("skipping checkpoint: %s", err.message)
            problems.append(err.message)
            continue
        if problems:
            log.warning("resuming from older checkpoint %s", folder.name)
        return found
    raise CheckpointError(f"no complete checkpoint in {root}"
                          + (": " + "; ".join(problems) if problems else ""),
                          "train without resume=True to start from scratch")


def load_replica(found: Found, stage: int, replica: int) -> dict[str, Any] | None:
    """Replica ``replica``'s own state of stage ``stage`` (:func:`save_stage` with a
    replica), or None when the checkpoint has none (it was not trained with LocalSGD)."""
    entry = (found.manifest.get("replica_files") or {}).get(f"{stage}.{replica}")
    if entry is None:
        return None
    return _load(found.folder / entry["file"], stage)


def load_stage(found: Found, stage: int) -> dict[str, Any]:
    """Stage ``stage``'s state from a complete checkpoint (``weights_only=True``)."""
    return _load(found.stage_file(stage), stage)


def _load(path: Path, stage: int) -> dict[str, Any]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - torch raises many types for a bad file
        raise CheckpointError(f"cannot load {path}: {type(err).__name__}: {err}",
                              "the file is corrupt; delete that checkpoint folder to fall back "
                              "to an older one") from err
    if not isinstance(state, dict) or state.get("stage") != stage or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not fxpipe stage {stage}'s checkpoint")
    return state


def prune(directory: str | os.PathLike[str], keep: int, num_stages: int) -> None:
    """Delete all but the newest ``keep`` COMPLETE checkpoints, plus incomplete ones older than
    the newest complete one. Never touches anything newer than the newest complete checkpoint
    (it may be in the middle of being written)."""
    root = Path(directory)
    items = sorted(((int(m.group(1)), int(m.group(2))), p) for p in root.iterdir()
                   if (m := _NAME.match(p.name)) and p.is_dir())
    complete = [(pos, p) for pos, p in items if (p / "manifest.json").is_file()]
    if not complete:
        return
    newest = complete[-1][0]
    keep_set = {p for _, p in complete[-keep:]} if keep > 0 else {complete[-1][1]}
    for pos, p in items:
        if pos < newest and p not in keep_set:
            shutil.rmtree(p, ignore_errors=True)
            log.info("deleted old checkpoint %s", p.name)


def load_model_state(directory: str | os.PathLike[str], num_stages: int | None = None, *,
                     verify: bool = True) -> dict[str, torch.Tensor]:
    """The whole model's weights and buffers (the stage GraphModules' names) re-assembled from
    the newest complete checkpoint's per-stage files: what ``model.load_state_dict`` takes after
    a pipelined run, without any process of the run holding the whole model. ``num_stages``:
    checked against the manifest when given."""
    root = Path(directory)
    if num_stages is None:
        found = _newest_manifest(root)
        num_stages = int(found.get("num_stages", 0)) if found else 0
    latest = find_latest(root, num_stages, verify=verify)
    out: dict[str, torch.Tensor] = {}
    for s in range(num_stages):
        state = load_stage(latest, s)
        for key in ("weights", "buffers"):
            for name, t in (state.get(key) or {}).items():
                out.setdefault(name, t)  # a tied weight: the lowest stage's copy (identical)
    return out


def _newest_manifest(root: Path) -> dict[str, Any] | None:
    """The newest readable manifest in ``root`` (to learn the number of stages)."""
    names = sorted((p for p in root.iterdir() if _NAME.match(p.name) and p.is_dir()),
                   reverse=True) if root.is_dir() else []
    for p in names:
        try:
            return json.loads((p / "manifest.json").read_text())
        except (OSError, ValueError):
            continue
    return None
