"""Fixtures of the modules that test through one node + gateway stack over real HTTP
(``running_stack`` in test_streaming.py builds it): one stack per module, and the tiny model's tokenizer."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from flywheel import lm
from tests.integration.test_streaming import Served, running_stack


@pytest.fixture(scope="module")
def served(request, tmp_path_factory, tiny_model_dir) -> Iterator[Served]:
    with running_stack(tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1]), tiny_model_dir) as stack:
        yield stack


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return lm.load_model(tiny_model_dir)[1]
