"""Fixtures for the costmodel tests (helpers live in cm_helpers.py)."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
