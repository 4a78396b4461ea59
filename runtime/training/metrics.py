"""Metrics a user reads after the run: JSON lines (``metrics_path=``) and TensorBoard.

Rank 0 writes a record at a segment end, every ``metrics_every`` updates at the earliest, where
the ranks exchange the segment's losses anyway: ``train`` (step, loss, lr, samples_per_s, time_s,
busy_s per stage; ``1 - busy_s / time_s`` is a stage's idle share) and ``eval`` records."""
from __future__ import annotations

import json
import logging
import os
from typing import Any

from ..errors import RuntimeConfigError

log = logging.getLogger(__name__)


def open_tensorboard(logdir: str) -> Any:
    """A ``SummaryWriter``, or a clear error naming the missing package."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        raise RuntimeConfigError(f"tensorboard_dir={logdir!r} but TensorBoard is not "
                                 f"installed ({err})", "pip install tensorboard, or leave "
                                 "tensorboard_dir unset (metrics_path= writes a JSON-lines "
                                 "log without it)") from err
    return SummaryWriter(logdir)


def check_tensorboard(logdir: str | None) -> None:
    """Fail at construction, not after the first segment, when TensorBoard is asked for but
    cannot be imported."""
    if logdir is None:
        return
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        open_tensorboard(logdir)


class MetricsLog:
    """Accumulates per-segment numbers and writes a record every ``every`` updates (see the
    module doc). ``write``: whether this process writes (rank 0)."""

    def __init__(self, path: str | None, every: int, tensorboard_dir: str | None,
                 num_stages: int, write: bool) -> None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise RuntimeConfigError(f"metrics_every={every!r}", "use a positive number of "
                                     "updates")
        check_tensorboard(tensorboard_dir)
        self.path, self.every, self.write = path, every, write
        self.enabled = path is not None or tensorboard_dir is not None
        self._tb_dir = tensorboard_dir
        self._tb: Any = None
        self.num_stages = num_stages
        self.step = 0
        self._last = 0
        self._reset()
        if self.write and path is not None:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def _reset(self) -> None:
        self._loss = [0.0, 0.0]
        self._minibatches = self._samples = 0
        self._time = 0.0
        self._busy = [0.0] * self.num_stages

    def segment(self, *, epoch: int, updates: int, loss_sum: float, losses: float,
                minibatches: int, samples: int, time_s: float, busy: list[float],
                lr: float | None, peak: list[int] | None = None) -> None:
        """Account one segment; write a record if ``every`` updates passed since the last."""
        self.step += updates
        self._loss = [self._loss[0] + loss_sum, self._loss[1] + losses]
        self._minibatches += minibatches
        self._samples += samples
        self._time += time_s
        self._busy = [a + b for a, b in zip(self._busy, busy)]
        if self.step - self._last < self.every:
            return
        self._emit({"kind": "train", "epoch": epoch + 1, "step": self.step,
                    "minibatches": self._minibatches,
                    "loss": self._loss[0] / max(self._loss[1], 1), "lr": lr,
                    "samples_per_s": self._samples / self._time if self._time > 0 else 0.0,
                    "time_s": self._time, "busy_s": self._busy,
                    **({"peak_tensor_bytes": peak} if peak is not None else {})})
        self._last = self.step
        self._reset()

    def evaluation(self, epoch: int, values: dict[str, float]) -> None:
        self._emit({"kind": "eval", "epoch": epoch + 1, "step": self.step, **values})

    def _emit(self, record: dict[str, Any]) -> None:
        if not (self.enabled and self.write):
            return
        if self.path is not None:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
        if self._tb_dir is not None:
            if self._tb is None:
                self._tb = open_tensorboard(self._tb_dir)
            for k, v in record.items():
                if isinstance(v, (int, float)) and k not in ("step", "epoch"):
                    self._tb.add_scalar(f"{record['kind']}/{k}", v, record["step"])
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
