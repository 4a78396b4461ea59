"""Checkpoint files (atomic writes, manifests, fallback, pruning) and the data helpers."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fxpipe.runtime.training import checkpoint as ck
from fxpipe.runtime.training.data import ShardedDataset, iter_parts


def _save(root: Path, epoch: int, mb: int, stages: int = 2, manifest: bool = True) -> None:
    for s in range(stages):
        ck.save_stage(root, epoch, mb, s, {"weights": {"w": torch.full((2,), float(mb))}})
    if manifest:
        ck.write_manifest(root, epoch, mb, stages, {"history": []})


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    ck.atomic_write(path, lambda f: f.write(b"old"))

    def boom(f) -> None:
        f.write(b"half")
        raise OSError("disk full")
    with pytest.raises(OSError):
        ck.atomic_write(path, boom)
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]  # no temporary left behind


def test_find_latest_skips_incomplete_and_corrupt_checkpoints(tmp_path: Path) -> None:
    _save(tmp_path, 0, 2)
    _save(tmp_path, 0, 4)
    _save(tmp_path, 0, 6, manifest=False)  # a stage (or rank 0) died before the manifest
    assert ck.find_latest(tmp_path, 2).minibatch == 4
    (tmp_path / "e0000-m0000004" / "stage0.pt").write_bytes(b"x" * 10)
    found = ck.find_latest(tmp_path, 2)
    assert (found.epoch, found.minibatch) == (0, 2)
    assert torch.equal(ck.load_stage(found, 1)["weights"]["w"], torch.full((2,), 2.0))
    with pytest.raises(ck.CheckpointError, match="format 1 with 2 stages, expected"):
        ck.check_folder(found.folder, 3, verify=True)


def test_load_stage_of_a_bad_file_is_a_checkpoint_error(tmp_path: Path) -> None:
    _save(tmp_path, 1, 0)
    found = ck.find_latest(tmp_path, 2, verify=False)
    found.stage_file(1).write_bytes(b"not a zip" * 3)
    with pytest.raises(ck.CheckpointError, match="cannot load"):
        ck.load_stage(found, 1)


def test_prune_keeps_the_newest_complete_and_never_touches_newer_ones(tmp_path: Path) -> None:
    for mb in (2, 4, 6):
        _save(tmp_path, 0, mb)
    _save(tmp_path, 0, 8, manifest=False)  # being written right now
    ck.prune(tmp_path, 2, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e0000-m0000004", "e0000-m0000006",
                                                         "e0000-m0000008"]


def test_sharded_dataset_reads_only_the_needed_part_and_is_deterministic() -> None:
    reads: list[str] = []

    def inputs(idx: torch.Tensor) -> torch.Tensor:
        reads.append("x")
        return idx.float()[:, None]

    def targets(idx: torch.Tensor) -> torch.Tensor:
        reads.append("y")
        return idx

    ds = ShardedDataset(inputs, targets, batch_size=3, num_samples=10, seed=5)
    assert len(ds) == 4
    ys = [y for _, y in ds.iter_parts(1, False, True)]
    assert set(reads) == {"y"} and sum(len(y) for y in ys) == 10
    xs = [x for x, _ in iter_parts(ds, 1, 0, need_inputs=True, need_targets=False, start=2)]
    assert [x[:, 0].long().tolist() for x in xs] == [y.tolist() for y in ys[2:]]
    assert not torch.equal(ds.order(0), ds.order(1))


def test_iter_parts_makes_a_shuffling_dataloader_deterministic() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(12.0), torch.arange(12))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    first = [y.tolist() for _, y in iter_parts(loader, 3, 0, need_inputs=False, need_targets=True)]
    torch.manual_seed(123)  # whatever happened to the global RNG in between
    again = [y.tolist() for _, y in iter_parts(loader, 3, 0, need_inputs=True, need_targets=True)]
    assert first == again
