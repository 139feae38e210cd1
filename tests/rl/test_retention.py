"""Which published policies a run keeps (`plies.rl.retain`): pruned from a real policy store,
which still opens and serves what is kept, with `retention.json` naming what was removed; and
refused, before anything is removed, where the policies are neither on this disk nor deletable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plies import ConfigError, PolicyRef
from plies.rl import retain
from plies.rl._retention import RETENTION_FILE, kept_versions, removed_versions
from plies.server import PolicyStore

pytestmark = pytest.mark.anyio


def _model(root: Path) -> Path:
    """A model directory as the store sees one: weight files it hashes, nothing to load."""
    root.mkdir()
    (root / "model.safetensors").write_bytes(b"weights of the base model")
    (root / "config.json").write_text("{}")
    return root


def _run_with_policies(tmp_path: Path, newest: int) -> tuple[Path, PolicyStore, Path]:
    """A run directory whose store holds versions 0..newest, each with its own weights."""
    out, model = tmp_path / "run", _model(tmp_path / "model")
    store = PolicyStore.open(out / "server", model)
    for version in range(1, newest + 1):
        source = tmp_path / f"v{version}"
        source.mkdir()
        (source / "model.safetensors").write_bytes(f"weights {version}".encode())
        assert store.publish_dir(source).version == version
    return out, store, model


async def _prune(out: Path, store: PolicyStore, **keep: int | None) -> list[int]:
    """`retain` as a run calls it: with the newest policy the run published, which names the
    store on this disk (a native trainer deletes nothing itself)."""
    removed, failures = await retain(out, [store.latest()], trainer=None, warm=1, **keep)
    assert failures == []
    return removed


async def test_a_prune_keeps_base_warm_start_and_the_newest_and_records_the_rest(tmp_path):
    out, store, model = _run_with_policies(tmp_path, 12)
    removed = await _prune(out, store, keep=3, max_staleness=None)
    assert removed == list(range(2, 10))
    reopened = PolicyStore.open(out / "server", model)  # as a resumed run's server does
    assert reopened.versions() == [0, 1, 10, 11, 12]
    assert reopened.latest().version == 12
    record = json.loads((out / RETENTION_FILE).read_text())
    assert record == {"keep_policies": 3, "kept": [0, 1, 10, 11, 12], "removed": removed}
    assert removed_versions(out) == set(removed)
    # The next publication after a prune gets the next number, not a reused one.
    source = tmp_path / "v13"
    source.mkdir()
    (source / "model.safetensors").write_bytes(b"weights 13")
    assert reopened.publish_dir(source).version == 13
    await _prune(out, reopened, keep=3, max_staleness=None)
    assert removed_versions(out) == set(range(2, 11))  # accumulated over prunes


async def test_while_sampling_the_versions_groups_may_still_sample_from_stay(tmp_path):
    out, store, _ = _run_with_policies(tmp_path, 6)
    await _prune(out, store, keep=1, max_staleness=2)
    assert store.versions() == [0, 1, 4, 5, 6]
    await _prune(out, store, keep=1, max_staleness=None)  # sampling over
    assert store.versions() == [0, 1, 6]


async def test_keep_all_removes_nothing_and_says_so(tmp_path):
    out, store, _ = _run_with_policies(tmp_path, 5)
    assert await _prune(out, store, keep=None, max_staleness=None) == []
    assert store.versions() == list(range(6))
    assert json.loads((out / RETENTION_FILE).read_text())["keep_policies"] == "all"


async def test_policies_a_trainer_cannot_delete_are_refused_and_nothing_is_recorded(tmp_path):
    remote = [PolicyRef(uri=f"https://policies.example/run/{v}", version=v) for v in range(4)]
    with pytest.raises(ConfigError, match=r"keep_policies=1: .*https://policies.example/run/3"):
        await retain(tmp_path, remote, trainer=object(), warm=None, keep=1, max_staleness=None)
    assert not (tmp_path / RETENTION_FILE).exists()
    # Keeping them all needs no deletion: recorded as such.
    assert await retain(
        tmp_path, remote, trainer=object(), warm=None, keep=None, max_staleness=None
    ) == ([], [])
    assert json.loads((tmp_path / RETENTION_FILE).read_text())["kept"] == [0, 1, 2, 3]


def test_a_removal_cut_off_midway_leaves_nothing_that_looks_published(tmp_path):
    out, store, model = _run_with_policies(tmp_path, 4)
    # What a crash between the rename and the delete leaves behind:
    (store.root / "2").rename(store.root / ".tmp-removed-2")
    reopened = PolicyStore.open(out / "server", model)
    assert reopened.versions() == [0, 1, 3, 4]
    assert not (store.root / ".tmp-removed-2").exists()


@pytest.mark.parametrize(
    ("published", "warm", "keep", "max_staleness", "kept"),
    [
        ([0], None, 3, 2, {0}),
        ([0, 1], 1, 1, None, {0, 1}),
        ([0, 1, 2, 3, 4, 5], None, 2, None, {0, 4, 5}),  # before the warm start is logged
        ([0, 1, 2, 3, 4, 5], 1, 5, 2, {0, 1, 2, 3, 4, 5}),
        ([0, 1, 2, 3, 4, 5], 1, 1, 2, {0, 1, 3, 4, 5}),  # in flight: the newest 3 stay
    ],
)
def test_kept_versions(published, warm, keep, max_staleness, kept):
    assert kept_versions(published, warm=warm, keep=keep, max_staleness=max_staleness) == kept
