"""The Tinker service: sessions, tenants, sampling sessions and futures of one server.

It is built with the app (`create_app`) and started in the app's lifespan once the store,
engine and tokenizer exist; the routes (`_routes.py`) only parse, check and call it.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from pathlib import Path
from typing import Any

import anyio

from .._config import ServerConfig
from .._state import ServerState
from ._errors import TinkerRequestError
from ._futures import Futures, Result, WorkQueue
from ._proto import ForwardBackwardInput
from ._samplers import Sampler, Samplers
from ._schemas import AdamParams, AsampleRequest, CreateModelRequest, SaveForSamplerRequest
from ._tenants import Tenant

__all__ = ["TinkerService"]

log = logging.getLogger("plies.server.tinker")


def _safe(model_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in model_id)


class TinkerService:
    """What the Tinker routes act on; `run` starts it inside the app's lifespan."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.limits = config.tinker
        self.futures = Futures()
        self.work = WorkQueue(self.futures, self.limits.gap_seconds)
        self.sessions: dict[str, list[str]] = {}
        self.tenants: dict[str, Tenant] = {}
        self.state: ServerState | None = None
        self.samplers: Samplers | None = None
        self.vocab = 0
        self.arch = ""
        self._tg: anyio.abc.TaskGroup | None = None

    async def run(self, state: ServerState, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled: the ordered work queue and the sampling tasks."""
        from transformers import AutoConfig

        base = await anyio.to_thread.run_sync(AutoConfig.from_pretrained, self.base_dir(state))
        self.vocab, self.arch = base.vocab_size, base.model_type
        self.state = state
        self.samplers = Samplers(state.engine, state.tokenizer, self.limits.max_loaded_samplers)
        async with anyio.create_task_group() as tg:
            self._tg = tg
            await tg.start(self.work.run)
            task_status.started()

    @staticmethod
    def base_dir(state: ServerState) -> Path:
        return state.store.path(0)

    @property
    def model_name(self) -> str:
        return self.config.served_model_name

    def _state(self) -> ServerState:
        if self.state is None or self.samplers is None:
            raise TinkerRequestError("the server is still starting", status=503)
        return self.state

    def tokenizer_id(self) -> str:
        """Where the SDK loads the tokenizer from: a local directory, if its path allows."""
        path = str(self.base_dir(self._state()).resolve())
        return path if ":" not in path else self.model_name

    # -- sessions and models ----------------------------------------------------------------

    def create_session(self) -> str:
        session_id = f"session-{uuid.uuid4().hex[:16]}"
        self.sessions[session_id] = []
        return session_id

    def finish_session(self, session_id: str) -> None:
        """Free the session's tenants; their sampler snapshots stay usable."""
        for model_id in self.sessions.pop(session_id, []):
            self.work.close(model_id)
            self.tenants.pop(model_id, None)

    def tenant(self, model_id: str) -> Tenant:
        tenant = self.tenants.get(model_id)
        if tenant is None:
            raise TinkerRequestError(f"unknown model_id {model_id!r}", status=404)
        return tenant

    def create_model(self, req: CreateModelRequest, digest: str) -> dict[str, Any]:
        state = self._state()
        if req.session_id not in self.sessions:
            raise TinkerRequestError(f"unknown session_id {req.session_id!r}", status=404)
        if req.base_model != self.model_name:
            raise TinkerRequestError(
                f"base_model {req.base_model!r} is not served here; this server trains "
                f"{self.model_name!r} (plies serve --model-name)"
            )
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        if model_id not in self.tenants:
            if len(self.tenants) >= self.limits.max_models:
                raise TinkerRequestError(
                    f"{len(self.tenants)} models are already held (plies serve --max-models "
                    f"{self.limits.max_models}); finish a session to free its models"
                )
            root = state.config.state_dir / "tinker" / _safe(model_id)
            tenant = Tenant(model_id, req.session_id, req.lora_config, root, state.config.trainer)
            self.tenants[model_id] = tenant
            self.sessions[req.session_id].append(model_id)
            self.work.open(model_id)
        tenant = self.tenants[model_id]
        base, device = self.base_dir(state), state.engine.device
        rid = self.work.submit(model_id, 0, digest, lambda: tenant.build(base, device))
        return {"request_id": rid, "model_id": model_id}

    def info(self, model_id: str) -> dict[str, Any]:
        tenant = self.tenant(model_id)
        out: dict[str, Any] = {
            "type": "get_info",
            "model_id": model_id,
            "model_data": {
                "arch": self.arch,
                "model_name": self.model_name,
                "tokenizer_id": self.tokenizer_id(),
            },
            "model_name": self.model_name,
            "is_lora": tenant.lora is not None,
        }
        if tenant.lora is not None:
            out["lora_rank"] = tenant.lora.rank
        return out

    # -- ordered training ops ---------------------------------------------------------------

    def refuse(self, model_id: str, seq_id: int, digest: str) -> None:
        """Consume `seq_id` of a request refused at submit, so later ones still run."""
        if model_id in self.work:
            with contextlib.suppress(TinkerRequestError):  # a repeat or a stale seq_id
                self.work.submit(model_id, seq_id, digest, None)

    def forward_backward(self, inp: ForwardBackwardInput, digest: str) -> dict[str, Any]:
        tenant = self.tenant(inp.model_id)
        rid = self.work.submit(
            inp.model_id, inp.seq_id, digest, lambda: tenant.forward_backward(inp)
        )
        return {"request_id": rid, "model_id": inp.model_id}

    def optim_step(
        self, model_id: str, seq_id: int, params: AdamParams, digest: str
    ) -> dict[str, Any]:
        tenant = self.tenant(model_id)
        rid = self.work.submit(model_id, seq_id, digest, lambda: tenant.optim_step(params))
        return {"request_id": rid, "model_id": model_id}

    def save_for_sampler(self, req: SaveForSamplerRequest, digest: str) -> dict[str, Any]:
        state = self._state()
        samplers = self.samplers
        assert samplers is not None
        tenant = self.tenant(req.model_id)
        if req.path is None and req.sampling_session_seq_id is None:
            raise TinkerRequestError(
                "save_weights_for_sampler needs a path or a sampling_session_seq_id"
            )

        def op() -> Result:
            policy_dir = tenant.snapshot(state.tokenizer)
            if req.path is not None:
                path = f"tinker://{req.model_id}/sampler_weights/{req.path}"
                samplers.paths[path] = policy_dir
                return {"path": path, "type": "save_weights_for_sampler"}
            sampler_id = f"{tenant.session_id}:sample:{req.sampling_session_seq_id}"
            samplers.sessions[sampler_id] = Sampler(sampler_id, self.model_name, None, policy_dir)
            return {
                "path": None,
                "sampling_session_id": sampler_id,
                "type": "save_weights_for_sampler",
            }

        rid = self.work.submit(req.model_id, req.seq_id, digest, op)
        return {"request_id": rid, "model_id": req.model_id}

    # -- sampling ---------------------------------------------------------------------------

    def create_sampler(
        self, session_id: str, seq: int, model_path: str | None, base_model: str | None
    ) -> str:
        state = self._state()
        samplers = self.samplers
        assert samplers is not None
        if session_id not in self.sessions:
            raise TinkerRequestError(f"unknown session_id {session_id!r}", status=404)
        if base_model is not None and base_model != self.model_name:
            raise TinkerRequestError(
                f"base_model {base_model!r} is not served here; this server serves "
                f"{self.model_name!r}"
            )
        if model_path is not None:
            policy_dir = samplers.paths.get(model_path)
            if policy_dir is None:
                raise TinkerRequestError(
                    f"unknown model_path {model_path!r}: this server samples from the sampler "
                    "weights saved by save_weights_for_sampler on it (tinker://.../sampler_weights/...)",
                    status=404,
                )
        else:
            policy_dir = self.base_dir(state)
        sampler_id = f"{session_id}:sample:{seq}"
        samplers.sessions[sampler_id] = Sampler(sampler_id, self.model_name, model_path, policy_dir)
        return sampler_id

    def asample(self, req: AsampleRequest) -> dict[str, Any]:
        state = self._state()
        samplers = self.samplers
        assert samplers is not None and self._tg is not None
        unsupported = req.unsupported()
        if unsupported:
            raise TinkerRequestError(
                f"{', '.join(unsupported)} are not supported by plies serve yet"
            )
        if req.sampling_session_id is None:
            raise TinkerRequestError("asample needs a sampling_session_id")
        sampler = samplers.get(req.sampling_session_id)
        if req.num_samples > self.limits.max_samples:
            raise TinkerRequestError(
                f"num_samples {req.num_samples} exceeds the limit {self.limits.max_samples}"
            )
        bad = next((t for t in req.prompt_tokens if not 0 <= t < self.vocab), None)
        if bad is not None:
            raise TinkerRequestError(
                f"prompt token id {bad} is outside the vocabulary [0, {self.vocab})"
            )
        max_len = state.config.max_model_len
        samplers.params(req, max_len)  # refuse bad parameters before answering with a future
        rid = self.futures.create()

        async def run() -> None:
            try:
                self.futures.settle(rid, await samplers.sample(sampler, req, max_len))
            except TinkerRequestError as exc:
                self.futures.fail(rid, str(exc))
            except Exception as exc:
                log.exception("asample %s failed", rid)
                self.futures.fail(rid, f"{type(exc).__name__}: {exc}")

        self._tg.start_soon(run)
        return {
            "request_id": rid,
            "sample_sequence_ids": [f"{rid}:{i}" for i in range(req.num_samples)],
        }
