"""Fixtures for the codegen tests (helpers live in _codegen_helpers.py)."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Deterministic weights and inputs in every test."""
    torch.manual_seed(0)
