"""Shared fixtures: the offline tokenizer and tiny model, built once per machine and cached."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from plies import models


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir() -> Path:
    return models.qwen3_tokenizer_dir()


@pytest.fixture(scope="session")
def qwen3_tokenizer(qwen3_tokenizer_dir: Path):
    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return models.tiny_model_dir()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
