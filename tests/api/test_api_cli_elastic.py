"""``fxpipe.cli_train --elastic`` (fxpipe/cli_elastic.py): what a (re)start decides.

The elastic restart itself (torchrun's agent, a host killed, the survivors re-planning) is
exercised on emulated hosts by bench/elastic.py; a re-partitioned resume under torchrun by
tests/runtime/training/test_runtime_repartition.py."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from fxpipe.cli_elastic import check_elastic, elastic_resume
from fxpipe.errors import ConfigError
from fxpipe.runtime.training import checkpoint as ckpt


def _args(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**{"checkpoint_dir": None, "plan": None, **kw})


def test_elastic_needs_a_checkpoint_dir_and_no_fixed_plan(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--elastic without --checkpoint-dir"):
        check_elastic(_args())
    with pytest.raises(ConfigError, match="re-plans for every world size"):
        check_elastic(_args(checkpoint_dir=str(tmp_path), plan="plan.json"))


def test_a_start_resumes_only_from_a_complete_checkpoint(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    args = _args(checkpoint_dir=str(tmp_path))
    assert elastic_resume(args, [1, 1]) is False
    assert "restart 1, world 2, plan replicas [1, 1]: starting fresh" in capsys.readouterr().out
    for s in range(3):  # a 3-stage checkpoint whose manifest was never written: incomplete
        ckpt.save_stage(tmp_path, 0, 8, s, {"weights": {"w": torch.zeros(1)}})
    assert elastic_resume(args, [1, 1]) is False
    ckpt.write_manifest(tmp_path, 0, 8, 3, {"replicas": [1, 1, 1]})
    assert elastic_resume(args, [1, 1]) is True
    assert ("resuming from e0000-m0000008 (3 stages, replicas [1, 1, 1])"
            in capsys.readouterr().out)
