"""Fixtures the unit tests share: a fresh, printed random seed."""

import random

import pytest


@pytest.fixture
def rng() -> random.Random:
    """A fresh seed every run; printed so a failure can be replayed."""
    seed = random.SystemRandom().getrandbits(32)
    print(f"codec test seed: {seed}")
    return random.Random(seed)
