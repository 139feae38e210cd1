"""The REST views of runs and checkpoints: `training_runs`, `checkpoints`, `weights_info`.

What the SDK's `RestClient` reads: a run is a tenant's `run.json` (so it outlives the tenant),
its training checkpoints are on disk (`_checkpoints.py`), and its named sampler weights are
the `tinker://{run}/sampler_weights/{name}` paths this server published.
"""

from __future__ import annotations

from typing import Any

from ._checkpoints import CheckpointPath, Runs, iso, parse_tinker_path, sampler_entry
from ._errors import TinkerRequestError
from ._samplers import Samplers

__all__ = ["TrainingRuns"]

MODEL_OWNER = "local"


def _page(items: list[dict[str, Any]], limit: int, offset: int) -> tuple[list, dict[str, int]]:
    if limit < 0 or offset < 0:
        raise TinkerRequestError("limit and offset must not be negative")
    cursor = {"offset": offset, "limit": limit, "total_count": len(items)}
    return items[offset : offset + limit], cursor


class TrainingRuns:
    """Read and delete what `Runs` holds, in the SDK's shapes."""

    def __init__(self, runs: Runs, samplers: Samplers):
        self.runs = runs
        self.samplers = samplers

    def lora(self, path: CheckpointPath) -> dict[str, Any] | None:
        """The LoRA config of the weights at `path` (None: a full fine-tune).

        Raises:
            TinkerRequestError: no such run or checkpoint (404).
        """
        if path.kind == "weights":
            return self.runs.meta(path)["lora"]
        if path.uri not in self.samplers.paths:
            raise TinkerRequestError(f"no sampler weights {path.uri} on this server", status=404)
        return self.runs.get(path.run_id)["lora"]

    def weights_info(self, tinker_path: str) -> dict[str, Any]:
        path = parse_tinker_path(tinker_path)
        lora = self.lora(path)
        out: dict[str, Any] = {
            "base_model": self.runs.get(path.run_id)["base_model"],
            "is_lora": lora is not None,
        }
        if lora is not None:
            out["lora_rank"] = lora["rank"]
            out.update({k: lora[k] for k in ("train_unembed", "train_mlp", "train_attn")})
        return out

    def checkpoints(self, run_id: str) -> list[dict[str, Any]]:
        """The run's training checkpoints, then its named sampler weights, each oldest first."""
        out = self.runs.checkpoints(run_id)
        prefix = f"tinker://{run_id}/sampler_weights/"
        samplers = [
            sampler_entry(parse_tinker_path(uri), policy_dir)
            for uri, policy_dir in self.samplers.paths.items()
            if uri.startswith(prefix) and policy_dir.is_dir()
        ]
        return out + sorted(samplers, key=lambda c: c["time"])

    def run(self, run_id: str) -> dict[str, Any]:
        record = self.runs.get(run_id)
        checkpoints = self.checkpoints(run_id)
        lora = record["lora"]
        out: dict[str, Any] = {
            "training_run_id": run_id,
            "base_model": record["base_model"],
            "model_owner": MODEL_OWNER,
            "is_lora": lora is not None,
            "corrupted": False,
            "last_request_time": max([iso(record["created"])] + [c["time"] for c in checkpoints]),
        }
        if lora is not None:
            out["lora_rank"] = lora["rank"]
        if record.get("user_metadata"):
            out["user_metadata"] = record["user_metadata"]
        for key, kind in (("last_checkpoint", "training"), ("last_sampler_checkpoint", "sampler")):
            of_kind = [c for c in checkpoints if c["checkpoint_type"] == kind]
            if of_kind:
                out[key] = of_kind[-1]
        return out

    def list_runs(self, limit: int, offset: int) -> dict[str, Any]:
        ids = [r["training_run_id"] for r in self.runs.all()]
        page, cursor = _page(ids, limit, offset)
        return {"training_runs": [self.run(i) for i in page], "cursor": cursor}

    def list_checkpoints(self, limit: int, offset: int) -> dict[str, Any]:
        """Every run's checkpoints (the SDK's `list_user_checkpoints`), newest first."""
        every = [c for r in self.runs.all() for c in self.checkpoints(r["training_run_id"])]
        every.sort(key=lambda c: c["time"], reverse=True)
        page, cursor = _page(every, limit, offset)
        return {"checkpoints": page, "cursor": cursor}

    def delete(self, run_id: str, checkpoint_id: str) -> None:
        """Delete `weights/<name>` from disk, or forget the sampler weights `sampler_weights/<name>`
        (a sampler already created from them keeps sampling).

        Raises:
            TinkerRequestError: a malformed id (400), no such run or checkpoint (404).
        """
        path = parse_tinker_path(f"tinker://{run_id}/{checkpoint_id}")
        if path.kind == "weights":
            self.runs.delete(path)
            return
        self.runs.get(run_id)
        if not self.samplers.forget_path(path.uri):
            raise TinkerRequestError(f"no sampler weights {path.uri} on this server", status=404)
