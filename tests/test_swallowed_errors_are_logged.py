"""Failures that plies tolerates on purpose still leave a log line saying what failed."""

from __future__ import annotations

import copy
import logging

import pytest

from plies.environments.openenv_client import _close_client
from plies.runtime import EnvPool, RolloutResources
from plies.tokens._parser import _generation_prompt
from plies.tokens._template import Template

REFUSING = "{{ raise_exception('this template renders nothing') }}"
"""A chat template whose every render fails."""


@pytest.fixture
def refusing(qwen3_tokenizer):
    """The real Qwen3 tokenizer with a chat template that refuses every render."""
    tokenizer = copy.deepcopy(qwen3_tokenizer)
    tokenizer.chat_template = REFUSING
    return tokenizer


class BrokenRefs:
    """A resource whose `remote_refs()` (user code) raises."""

    def remote_refs(self):
        raise RuntimeError("remote_refs exploded")

    async def aclose(self) -> None:
        pass


class BrokenClose:
    async def close(self) -> None:
        raise OSError("connection reset while closing")


def test_a_template_that_refuses_a_discovery_render_is_logged(caplog, refusing):
    caplog.set_level(logging.DEBUG, logger="plies.tokens")
    template = Template(refusing, tools=None, template_kwargs={}, system=None)
    assert template.render_text([{"role": "user", "content": "x"}], generation_prompt=True) is None
    assert "this template renders nothing" in caplog.text


def test_a_template_without_a_generation_prompt_is_logged(caplog, refusing):
    caplog.set_level(logging.DEBUG, logger="plies.tokens")
    assert _generation_prompt(refusing, REFUSING, {}) == ""
    assert "this template renders nothing" in caplog.text


@pytest.mark.anyio
async def test_an_unreadable_remote_id_is_logged(caplog):
    async def make() -> BrokenRefs:
        return BrokenRefs()

    pool = EnvPool(make)
    async with RolloutResources(pools=[pool]), pool.borrow() as lease:
        assert lease.remote_id is None
    assert "remote_refs exploded" in caplog.text
    assert any(r.levelno == logging.WARNING for r in caplog.records)


@pytest.mark.anyio
async def test_a_failed_openenv_close_is_logged(caplog):
    assert await _close_client(BrokenClose(), 1.0) is False
    assert "connection reset while closing" in caplog.text
