"""What every notebook's setup cell needs: environment overrides and seeding."""
from __future__ import annotations

import os
import random

import numpy as np
import torch


def settings(fast: bool, interactive: bool) -> tuple[bool, bool]:
    """Apply ``WORKBENCH_FAST=1`` (CI's small sizes) and ``WORKBENCH_HEADLESS=1`` (no widgets)."""
    fast = bool(fast) or os.environ.get("WORKBENCH_FAST") == "1"
    interactive = bool(interactive) and os.environ.get("WORKBENCH_HEADLESS") != "1"
    return fast, interactive


def seed_everything(seed: int) -> None:
    """Same numbers every run: Python, NumPy and torch (all devices) seeded together."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
