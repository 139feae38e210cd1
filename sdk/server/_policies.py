"""The policy store: published policies as immutable directories on disk.

Layout::

    STATE_DIR/policies/0/           the initial model (a copy of MODEL_DIR)
    STATE_DIR/policies/1/           config.json, model.safetensors, tokenizer files, policy.json
    STATE_DIR/policies/.tmp-<hex>/  a publication in progress (removed when the store reopens)

A version is written to a temporary directory, fsynced, and renamed into place, so a reader
sees either nothing or a whole policy, and a published version is never overwritten. The
`PolicyRef` of each version is in its `policy.json`; its digest covers the weight files only,
so the same weights always get the same digest whatever the tokenizer files hold.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from .._durable import fsync_dir, fsync_tree
from .._exceptions import ConfigError, PliesError
from ..trajectory import PolicyRef

__all__ = ["POLICY_FILE", "PolicyStore", "confine", "weights_digest"]

POLICY_FILE = "policy.json"
_MAX_REF_BYTES = 64 << 10
"""A PolicyRef is a few hundred bytes; anything much larger is not one."""


def confine(path: Path, roots: Sequence[Path]) -> Path:
    """`path`, resolved, if it lies inside one of `roots` (resolved too); else refused.

    Resolving first follows every symlink, so a link inside a root that points outside it
    is judged by where it leads.

    Raises:
        ConfigError: the path does not exist or lies outside every root.
    """
    try:
        real = Path(path).resolve(strict=True)
    except (OSError, RuntimeError):
        raise ConfigError(f"{path} does not exist") from None
    allowed = [Path(r).resolve() for r in roots]
    if not any(real.is_relative_to(root) for root in allowed):
        raise ConfigError(
            f"{path} is outside the directories this server may load from "
            f"({', '.join(map(str, allowed))}); the operator can add one with --allow-path"
        )
    return real


def weights_digest(path: Path) -> str:
    """`sha256:` + sha256 over the names and bytes of a directory's safetensors files."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{path} holds no *.safetensors weight files")
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(b"\0")
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
    return "sha256:" + h.hexdigest()


class PolicyStore:
    """Published policies under `STATE_DIR/policies/`. Thread-safe within one process.

    Use `PolicyStore.open(state_dir, model_dir)` to get one with version 0 in place.

    Example:
        store = PolicyStore.open(Path("runs/a"), Path("models/tiny"))
        ref = store.publish(model, tokenizer)   # PolicyRef(version=1, ...)
        store.path(ref.version)                 # runs/a/policies/1
    """

    def __init__(self, state_dir: Path):
        self.root = Path(state_dir) / "policies"
        self._lock = threading.Lock()

    @classmethod
    def open(cls, state_dir: Path, model_dir: Path) -> PolicyStore:
        """Open (or create) a store; version 0 becomes a copy of `model_dir` if absent.

        Raises:
            ConfigError: `model_dir` has no weights, or the store's version 0 holds other
                weights than `model_dir` (the state dir belongs to another model).
        """
        store = cls(state_dir)
        store.root.mkdir(parents=True, exist_ok=True)
        for stale in store.root.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        digest = weights_digest(model_dir)
        if 0 in store.versions():
            if store.get(0).digest != digest:
                raise ConfigError(
                    f"state dir {state_dir} was started from other weights than {model_dir} "
                    f"(version 0 has {store.get(0).digest}, the model has {digest}); "
                    "use a new --state-dir"
                )
        else:
            store._commit(lambda tmp: shutil.copytree(model_dir, tmp, dirs_exist_ok=True), 0)
        return store

    def versions(self) -> list[int]:
        """Published versions, ascending."""
        return sorted(
            int(p.name)
            for p in self.root.iterdir()
            if p.name.isdigit() and (p / POLICY_FILE).exists()
        )

    def path(self, version: int) -> Path:
        """The directory of a published version.

        Raises:
            ConfigError: nothing is published under that version.
        """
        p = self.root / str(version)
        if not (p / POLICY_FILE).exists():
            raise ConfigError(f"policy version {version} is not published in {self.root}")
        return p

    def get(self, version: int) -> PolicyRef:
        """The `PolicyRef` of a published version."""
        return self.read_ref(self.path(version))

    def latest(self) -> PolicyRef:
        """The newest published policy."""
        versions = self.versions()
        if not versions:
            raise ConfigError(f"no policy is published in {self.root}")
        return self.get(versions[-1])

    @staticmethod
    def read_ref(path: Path) -> PolicyRef:
        """The `PolicyRef` of a published policy directory.

        The file is opened without following a symlink and its content is never quoted in
        an error, so a client that names a directory cannot make the server read, and echo,
        another file.

        Raises:
            ConfigError: the directory holds no readable, regular `policy.json`.
        """
        f = Path(path) / POLICY_FILE
        try:
            fd = os.open(f, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as fh:
                raw = fh.read(_MAX_REF_BYTES + 1)
        except FileNotFoundError:
            raise ConfigError(
                f"{path} is not a published policy directory (no {POLICY_FILE})"
            ) from None
        except OSError as e:
            why = f"cannot be read ({e.strerror})"
            if e.errno == errno.ELOOP:
                why = "is a symbolic link"
            raise ConfigError(f"{f} {why}; a published policy holds a regular file") from None
        if len(raw) > _MAX_REF_BYTES:
            raise ConfigError(f"{f} is larger than a PolicyRef ({_MAX_REF_BYTES} bytes)")
        try:
            return PolicyRef.model_validate_json(raw)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(map(str, first["loc"])) or "the file"
            raise ConfigError(f"{f} is not a valid PolicyRef ({where}: {first['msg']})") from None

    @classmethod
    def verify(cls, path: Path) -> PolicyRef:
        """The `PolicyRef` of a directory a client asked to load, once it is proven true.

        A `policy.json` could name any digest, so the weights are hashed again: a directory
        whose weights are not the ones its ref names would tag every sample with the wrong
        policy. Symlinks inside are refused: they could point the hash and the loader at
        different files, or outside the directories the server was allowed to read.

        Raises:
            ConfigError: not a published policy, a symlink inside, or a digest that lies.
        """
        ref = cls.read_ref(path)
        links = sorted(p.name for p in Path(path).iterdir() if p.is_symlink())
        if links:
            raise ConfigError(f"{path} holds symbolic links ({', '.join(links[:3])}); refused")
        actual = weights_digest(path)
        if actual != ref.digest:
            raise ConfigError(
                f"{path}/{POLICY_FILE} names digest {ref.digest} but its weights hash to "
                f"{actual}: a forged or damaged policy, refused"
            )
        return ref

    def publish(self, model: Any, tokenizer: Any) -> PolicyRef:
        """Write `model` and `tokenizer` (transformers objects) as the next version."""

        def write(tmp: Path) -> None:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)

        return self._commit(write, None)

    def publish_dir(self, source: Path) -> PolicyRef:
        """Copy a Hugging Face model directory in as the next version."""
        return self._commit(lambda tmp: shutil.copytree(source, tmp, dirs_exist_ok=True), None)

    def _commit(self, write, version: int | None) -> PolicyRef:
        with self._lock:
            if version is None:
                versions = self.versions()
                version = versions[-1] + 1 if versions else 0
            final = self.root / str(version)
            tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=self.root))
            try:
                write(tmp)
                (tmp / POLICY_FILE).unlink(missing_ok=True)
                ref = PolicyRef(
                    uri=final.resolve().as_uri(), version=version, digest=weights_digest(tmp)
                )
                (tmp / POLICY_FILE).write_text(ref.model_dump_json() + "\n")
                fsync_tree(tmp)
                if final.exists():
                    raise PliesError(f"policy version {version} already exists at {final}")
                os.rename(tmp, final)
                fsync_dir(self.root)
                return ref
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
