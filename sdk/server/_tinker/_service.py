"""The Tinker service: sessions, tenants, sampling sessions and futures of one server.

It is built with the app (`create_app`) and started in the app's lifespan once the store,
engine and tokenizer exist; the routes (`_routes.py`) only parse, check and call it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
from pydantic import ValidationError

from ..._durable import write_atomic
from .._config import ServerConfig
from .._faults import Faults
from .._quote import quoted
from .._state import ServerState
from ._checkpoints import CheckpointPath, Runs, check_name, parse_tinker_path
from ._errors import TinkerRequestError, error_body
from ._futures import Futures, Result, WorkQueue, failure_message
from ._oplog import CHANGES_STATE, DONE_FOR_GOOD, Replay, decode_result
from ._proto import ForwardBackwardInput, check_forward_backward, parse_forward_backward
from ._samplers import Sampler, Samplers
from ._schemas import (
    AsampleRequest,
    CreateModelRequest,
    LoadWeightsRequest,
    LoraConfig,
    OptimStepRequest,
    SaveForSamplerRequest,
    SaveWeightsRequest,
)
from ._tenants import Tenant
from ._training_runs import TrainingRuns

__all__ = ["SAMPLE_PREFIX", "TinkerService"]

SAMPLE_PREFIX = "sample"
"""asample's request ids: samples are not journaled, so one lost in a restart is answered
410 (promise expired), which the SDK retries as a new sample."""

log = logging.getLogger("plies.server.tinker")


class TinkerService:
    """What the Tinker routes act on; `run` starts it inside the app's lifespan."""

    def __init__(self, config: ServerConfig, faults: Faults | None = None):
        self.config = config
        self.faults = faults
        self.limits = config.tinker
        self.futures = Futures()
        self.work = WorkQueue(self.futures, self.limits.gap_seconds)
        self.sessions: dict[str, list[str]] = {}
        self.tenants: dict[str, Tenant] = {}
        self.state: ServerState | None = None
        self.samplers: Samplers | None = None
        self.runs = Runs(config.state_dir / "tinker")
        self.session_dir = self.runs.root / "sessions"
        self.training_runs: TrainingRuns | None = None
        self.vocab = 0
        self.arch = ""
        self._tg: anyio.abc.TaskGroup | None = None

    async def run(self, state: ServerState, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled: the ordered work queue and the sampling tasks. What a killed
        server held is recovered first (`_recover`), before the app reports ready."""
        from transformers import AutoConfig

        base = await anyio.to_thread.run_sync(AutoConfig.from_pretrained, self.base_dir(state))
        self.vocab, self.arch = base.vocab_size, base.model_type
        registry = self.runs.root / "samplers.jsonl"
        self.samplers = Samplers(
            state.engine, state.tokenizer, self.limits.max_loaded_samplers, registry
        )
        self.training_runs = TrainingRuns(self.runs, self.samplers)
        self.state = state
        await anyio.to_thread.run_sync(self._recover, state)
        async with anyio.create_task_group() as tg:
            self._tg = tg
            await tg.start(self.work.run)
            task_status.started()

    # -- recovery -------------------------------------------------------------------------

    def _recover(self, state: ServerState) -> None:
        """Bring a killed server's Tinker state back from the state directory: sessions,
        tenants, futures, queued ops (blocking: it loads weights).

        At start-up, before any route answers, every run that was live (not unloaded, its session
        not finished) gets its tenant back at the last state its op log holds (`_oplog.py`); every
        future the log settled settles again under its request id; and each op after that state is
        submitted again through the same checks as its route, under its old request id, so an SDK
        still polling it (or re-sending it) finds it. The ops at or before the state are only
        remembered, so a repeat of one gets its request id and is never applied again.
        """
        if self.session_dir.is_dir():
            self.sessions = {p.name: [] for p in self.session_dir.iterdir() if p.is_file()}
        for record in self.runs.all():
            if record.get("closed") or record.get("session_id") not in self.sessions:
                continue
            model_id, lora = record["training_run_id"], record["lora"]
            tenant = Tenant(
                model_id,
                record["session_id"],
                LoraConfig.model_validate(lora) if lora is not None else None,
                self.runs.dir(model_id),
                state.config.trainer,
            )
            self.tenants[model_id] = tenant
            self.sessions[tenant.session_id].append(model_id)
            ops = tenant.oplog.read()
            if ops.state is not None:
                tenant.build(self.base_dir(state), state.engine.device)
                tenant.restore(ops.state)
            self.work.open(model_id, first_seq=ops.state_seq + 1)
            for done in ops.done.values():
                self.futures.create(done["rid"])
                self.futures.settle(done["rid"], decode_result(done))
            again = 0
            for seq in sorted(ops.submits):
                sub = ops.submits[seq]
                rid, digest, kind = sub["rid"], sub["digest"], sub["kind"]
                if seq <= ops.state_seq:
                    self.work.remember(model_id, seq, digest, rid)
                    continue
                done = seq in ops.done
                if kind == "refused" or (done and kind in DONE_FOR_GOOD):
                    self.work.submit(model_id, seq, digest, None, rid=rid)
                    continue
                try:
                    self._resubmit(kind, tenant.oplog.body(seq), digest, Replay(rid, done))
                except (TinkerRequestError, ValidationError) as exc:  # e.g. the checkpoint it
                    # loads was deleted, or settings this version refuses
                    self.work.submit(model_id, seq, digest, None, rid=rid)
                    self.futures.fail(rid, str(exc))
                again += 1
            log.info("%s: recovered at seq_id %d, %d ops run again", model_id, ops.state_seq, again)

    def _resubmit(self, kind: str, body: bytes, digest: str, replay: Replay) -> None:
        """Submit a logged op again, through the same checks as its route."""
        if kind == "forward_backward":
            inp = check_forward_backward(
                parse_forward_backward(body),
                vocab=self.vocab,
                max_len=self.config.max_model_len,
                max_datums=self.limits.max_datums,
            )
            self.forward_backward(inp, digest, body, replay)
            return
        schema, handle = {
            "create": (CreateModelRequest, self.create_model),
            "optim_step": (OptimStepRequest, self.optim_step),
            "save_weights": (SaveWeightsRequest, self.save_weights),
            "save_weights_for_sampler": (SaveForSamplerRequest, self.save_for_sampler),
            "load_weights": (LoadWeightsRequest, self.load_weights),
        }[kind]
        handle(schema.model_validate_json(body), digest, body, replay)

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

    def runs_view(self) -> TrainingRuns:
        """The REST views of runs and checkpoints, once the server has started."""
        self._state()
        assert self.training_runs is not None
        return self.training_runs

    def tokenizer_id(self) -> str:
        """Where the SDK loads the tokenizer from: a local directory, if its path allows."""
        path = str(self.base_dir(self._state()).resolve())
        return path if ":" not in path else self.model_name

    # -- sessions and models ----------------------------------------------------------------

    def create_session(self) -> str:
        """A new session, on disk (`sessions/<id>`) so that it outlives a restart."""
        session_id = f"session-{uuid.uuid4().hex[:16]}"
        self.session_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(self.session_dir / session_id, b"")
        self.sessions[session_id] = []
        return session_id

    def finish_session(self, session_id: str) -> None:
        """Free the session's tenants; their sampler snapshots stay usable."""
        for model_id in list(self.sessions.get(session_id, [])):
            self.unload_model(model_id)
        self.sessions.pop(session_id, None)
        (self.session_dir / session_id).unlink(missing_ok=True)

    def unload_model(self, model_id: str) -> dict[str, Any]:
        """Free one tenant (its queued ops fail; an op already running finishes first). Its
        run, checkpoints and sampler weights stay, and no other tenant is touched."""
        tenant = self.tenant(model_id)
        self.work.close(model_id)
        del self.tenants[model_id]
        self.runs.close(model_id)
        with contextlib.suppress(KeyError, ValueError):
            self.sessions[tenant.session_id].remove(model_id)
        return {"model_id": model_id, "type": "unload_model"}

    def tenant(self, model_id: str) -> Tenant:
        tenant = self.tenants.get(model_id)
        if tenant is None:
            raise TinkerRequestError(f"unknown model_id {quoted(model_id)}", status=404)
        return tenant

    def create_model(
        self, req: CreateModelRequest, digest: str, body: bytes, replay: Replay | None = None
    ) -> dict[str, Any]:
        state = self._state()
        if req.session_id not in self.sessions:
            raise TinkerRequestError(f"unknown session_id {quoted(req.session_id)}", status=404)
        if req.base_model != self.model_name:
            raise TinkerRequestError(
                f"base_model {quoted(req.base_model)} is not served here; this server trains "
                f"{self.model_name!r} (plies serve --model-name)"
            )
        tenant = self._open_tenant(req.session_id, req.model_seq_id, req.lora_config)
        build = functools.partial(tenant.build, self.base_dir(state), state.engine.device)
        rid = self._ordered(tenant, 0, "create", digest, body, build, replay)
        return {"request_id": rid, "model_id": tenant.model_id}

    def _open_tenant(self, session_id: str, model_seq_id: int, lora: LoraConfig | None) -> Tenant:
        """The tenant `{session_id}:train:{model_seq_id}`, created (and its run recorded) if
        new; the caller submits its build as op 0."""
        state = self._state()
        model_id = f"{session_id}:train:{model_seq_id}"
        if model_id not in self.tenants:
            if len(self.tenants) >= self.limits.max_models:
                raise TinkerRequestError(
                    f"{len(self.tenants)} models are already held (plies serve --max-models "
                    f"{self.limits.max_models}); finish a session or unload a model to free one"
                )
            meta = {
                "base_model": self.model_name,
                "session_id": session_id,
                "lora": lora.model_dump() if lora is not None else None,
            }
            root = self.runs.create(model_id, meta)
            self.tenants[model_id] = Tenant(model_id, session_id, lora, root, state.config.trainer)
            self.sessions[session_id].append(model_id)
            self.work.open(model_id)
        return self.tenants[model_id]

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

    def _ordered(
        self,
        tenant: Tenant,
        seq: int,
        kind: str,
        digest: str,
        body: bytes,
        fn: Callable[[], Result],
        replay: Replay | None,
    ) -> str:
        """Queue `fn` as op `seq` of `tenant`, journaled for exactly-once (`_oplog.py`): the
        submit before it is answered, the outcome (and the state, for the kinds that change
        it) before its future settles. `replay` names an op brought back from the log."""
        oplog, faults = tenant.oplog, self.faults
        known = self.work.known(tenant.model_id, seq)
        rid = replay.rid if replay is not None else f"req-{uuid.uuid4().hex}"

        def run() -> Result:
            if faults is not None:
                faults.reached("before_apply")
            journal = replay is None or not replay.done
            try:
                value = fn()
            except Exception as exc:
                if journal:
                    oplog.done(seq, rid, error_body(failure_message(exc)))
                raise
            if kind in CHANGES_STATE:
                assert isinstance(value, dict)
                oplog.checkpoint(seq, tenant.saved_state({}), rid, value)
            if journal:
                oplog.done(seq, rid, value)
            if faults is not None:
                faults.reached("before_answer")
            return value

        got = self.work.submit(tenant.model_id, seq, digest, run, rid=rid)
        if not known and replay is None:
            oplog.submitted(seq, got, kind, digest, body)
        return got

    def refuse(self, model_id: str, seq_id: int, digest: str) -> None:
        """Consume `seq_id` of a request refused at submit, so later ones still run (and
        still do after a restart: the refusal is journaled like an op)."""
        tenant = self.tenants.get(model_id)
        if tenant is None or self.work.known(model_id, seq_id):
            return
        with contextlib.suppress(TinkerRequestError):  # a stale seq_id
            rid = self.work.submit(model_id, seq_id, digest, None)
            tenant.oplog.submitted(seq_id, rid, "refused", digest, b"")
            tenant.oplog.done(seq_id, rid, error_body("refused at submit"))

    def forward_backward(
        self, inp: ForwardBackwardInput, digest: str, body: bytes, replay: Replay | None = None
    ) -> Any:
        tenant = self.tenant(inp.model_id)
        fn = functools.partial(tenant.forward_backward, inp)
        rid = self._ordered(tenant, inp.seq_id, "forward_backward", digest, body, fn, replay)
        return {"request_id": rid, "model_id": inp.model_id}

    def optim_step(
        self, req: OptimStepRequest, digest: str, body: bytes, replay: Replay | None = None
    ) -> dict[str, Any]:
        tenant = self.tenant(req.model_id)
        if req.adam_params is None:
            raise TinkerRequestError(
                "only adam_params (AdamW) optim steps are supported by plies serve yet"
            )
        fn = functools.partial(tenant.optim_step, req.adam_params)
        rid = self._ordered(tenant, req.seq_id, "optim_step", digest, body, fn, replay)
        return {"request_id": rid, "model_id": req.model_id}

    def save_for_sampler(
        self,
        req: SaveForSamplerRequest,
        digest: str,
        body: bytes,
        replay: Replay | None = None,
    ) -> dict[str, Any]:
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
                samplers.add_path(path, policy_dir)
                return {"path": path, "type": "save_weights_for_sampler"}
            sampler_id = f"{tenant.session_id}:sample:{req.sampling_session_seq_id}"
            sampler = Sampler(sampler_id, self.model_name, None, policy_dir)
            samplers.add_session(sampler, snapshot=True)
            return {
                "path": None,
                "sampling_session_id": sampler_id,
                "type": "save_weights_for_sampler",
            }

        rid = self._ordered(
            tenant, req.seq_id, "save_weights_for_sampler", digest, body, op, replay
        )
        return {"request_id": rid, "model_id": req.model_id}

    def save_weights(
        self, req: SaveWeightsRequest, digest: str, body: bytes, replay: Replay | None = None
    ) -> dict[str, Any]:
        """Save the trainable weights and AdamW state as `tinker://{model_id}/weights/{name}`."""
        tenant = self.tenant(req.model_id)
        name = check_name(req.path if req.path is not None else f"seq-{req.seq_id:06d}")
        path = CheckpointPath(req.model_id, "weights", name)
        meta = {
            "model_id": req.model_id,
            "lora": tenant.lora.model_dump() if tenant.lora is not None else None,
            "user_metadata": req.user_metadata,
        }

        def op() -> Result:
            self.runs.write(path, tenant.saved_state(meta), overwrite=req.overwrite)
            return {"path": path.uri, "type": "save_weights"}

        rid = self._ordered(tenant, req.seq_id, "save_weights", digest, body, op, replay)
        return {"request_id": rid, "model_id": req.model_id}

    def load_weights(
        self, req: LoadWeightsRequest, digest: str, body: bytes, replay: Replay | None = None
    ) -> dict[str, Any]:
        """Load a training checkpoint, with its AdamW state if `req.optimizer`: into a new
        model `{session_id}:train:{model_seq_id}` (as its op 0), or into a live one."""
        state = self._state()
        path = parse_tinker_path(req.path)
        lora_meta = self.runs.meta(path)["lora"]
        kind = (req.optimizer_config or {}).get("type", "adamw")
        if kind != "adamw":
            raise TinkerRequestError(f"optimizer {quoted(kind)} is not supported; only adamw")
        if req.base_model is not None and req.base_model != self.model_name:
            raise TinkerRequestError(
                f"base_model {quoted(req.base_model)} is not served here; this server trains "
                f"{self.model_name!r}"
            )
        if req.session_id is not None and req.model_seq_id is not None:
            if req.session_id not in self.sessions:
                raise TinkerRequestError(f"unknown session_id {quoted(req.session_id)}", status=404)
            lora = LoraConfig.model_validate(lora_meta) if lora_meta is not None else None
            tenant, seq = self._open_tenant(req.session_id, req.model_seq_id, lora), 0
            base, device = self.base_dir(state), state.engine.device
        elif req.model_id is not None and req.seq_id is not None:
            tenant, seq, base = self.tenant(req.model_id), req.seq_id, None
        else:
            raise TinkerRequestError(
                "load_weights needs session_id and model_seq_id (a new model), or model_id "
                "and seq_id (a live one)"
            )

        def op() -> Result:
            if base is not None:
                tenant.build(base, device)
            tenant.restore(self.runs.read(path, optimizer=req.optimizer))
            return {"model_id": tenant.model_id, "path": req.path, "type": "load_weights"}

        rid = self._ordered(tenant, seq, "load_weights", digest, body, op, replay)
        return {"request_id": rid, "model_id": tenant.model_id}

    # -- sampling ---------------------------------------------------------------------------

    def create_sampler(
        self, session_id: str, seq: int, model_path: str | None, base_model: str | None
    ) -> str:
        state = self._state()
        samplers = self.samplers
        assert samplers is not None
        if session_id not in self.sessions:
            raise TinkerRequestError(f"unknown session_id {quoted(session_id)}", status=404)
        if base_model is not None and base_model != self.model_name:
            raise TinkerRequestError(
                f"base_model {quoted(base_model)} is not served here; this server serves "
                f"{self.model_name!r}"
            )
        if model_path is not None:
            policy_dir = samplers.paths.get(model_path)
            if policy_dir is None:
                raise TinkerRequestError(
                    f"unknown model_path {quoted(model_path)}: this server samples from the "
                    "sampler weights saved by save_weights_for_sampler on it (tinker://.../sampler_weights/...)",
                    status=404,
                )
        else:
            policy_dir = self.base_dir(state)
        sampler_id = f"{session_id}:sample:{seq}"
        samplers.add_session(Sampler(sampler_id, self.model_name, model_path, policy_dir))
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
        samplers.check(req, max_len)  # refuse bad parameters before answering with a future
        samplers.scoring(req)
        rid = self.futures.create(prefix=SAMPLE_PREFIX)

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
