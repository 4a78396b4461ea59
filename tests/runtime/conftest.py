"""Every distributed trainer job of these tests records its host calls, and they must pass the
NCCL checker (issue 27): a job's ranks each write one log per stretch of training (and per
evaluation) into the folder ``FXPIPE_COMM_LOG_DIR`` names (see
``fxpipe.runtime.execution.trainer_backends.COMM_LOG_ENV``); after the test, the logs of each
stretch, every rank's together, are replayed by ``check_logs``. (The spawned-world jobs of
``rt_spawn`` check their own logs.)

The tests live in one folder per runtime package (schedules/, pricing/, replica/, execution/,
training/); the helpers (``rt_*.py``, ``stale_oracles.py``) and the ``*_job.py`` scripts stay in
this folder. Tests import both, and each other, by bare module name: this folder and every package
folder go on ``sys.path`` here (``rt_procs.PATHS``; a job's ``PYTHONPATH`` holds the same)."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

for _folder in [Path(__file__).parent,
                *(Path(__file__).parent / p
                  for p in ("schedules", "pricing", "replica", "execution", "training"))]:
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

from fxpipe.runtime.execution.trainer_backends import COMM_LOG_ENV
from fxpipe.runtime.schedules.ncclcheck import check_logs

_NAME = re.compile(r"(?P<job>\d+-b\d+)-rank(?P<rank>\d+)-(?P<n>\d+)\.json")


def check_comm_logs(folder: Path) -> int:
    """Replay every recorded stretch of ``folder`` (all its ranks' logs together); returns how
    many were checked."""
    groups: dict[tuple[str, str], dict[int, list]] = {}
    for path in folder.glob("*.json"):
        m = _NAME.fullmatch(path.name)
        if m is None:
            continue
        groups.setdefault((m["job"], m["n"]), {})[int(m["rank"])] = json.loads(path.read_text())
    for key, logs in sorted(groups.items()):
        try:
            check_logs(logs)
        except Exception as err:  # noqa: BLE001 - say which stretch
            raise AssertionError(f"stretch {key} of a recorded job: {err}") from err
    return len(groups)


@pytest.fixture(autouse=True)
def nccl_rules(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    folder = tmp_path_factory.mktemp("comm-log")
    monkeypatch.setenv(COMM_LOG_ENV, str(folder))
    yield folder
    check_comm_logs(folder)
