"""Bringing a killed server's Tinker state back: sessions, tenants, futures, queued ops.

At start-up, before any route answers, every run that was live (not unloaded, its session
not finished) gets its tenant back at the last state its op log holds (`_oplog.py`); every
future the log settled settles again under its request id; and each op after that state is
submitted again through the same checks as its route, under its old request id, so an SDK
still polling it (or re-sending it) finds it. The ops at or before the state are only
remembered, so a repeat of one gets its request id and is never applied again.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pydantic import ValidationError

from .._state import ServerState
from ._errors import TinkerRequestError
from ._oplog import DONE_FOR_GOOD, Replay, decode_result
from ._proto import check_forward_backward, parse_forward_backward
from ._schemas import (
    CreateModelRequest,
    LoadWeightsRequest,
    LoraConfig,
    OptimStepRequest,
    SaveForSamplerRequest,
    SaveWeightsRequest,
)
from ._tenants import Tenant

if TYPE_CHECKING:
    from ._service import TinkerService

__all__ = ["recover"]

log = logging.getLogger("plies.server.tinker")


def recover(service: TinkerService, state: ServerState) -> None:
    """Restore `service` from its state directory (blocking: it loads weights)."""
    if service.session_dir.is_dir():
        service.sessions = {p.name: [] for p in service.session_dir.iterdir() if p.is_file()}
    for record in service.runs.all():
        if record.get("closed") or record.get("session_id") not in service.sessions:
            continue
        model_id, lora = record["training_run_id"], record["lora"]
        tenant = Tenant(
            model_id,
            record["session_id"],
            LoraConfig.model_validate(lora) if lora is not None else None,
            service.runs.dir(model_id),
            state.config.trainer,
        )
        service.tenants[model_id] = tenant
        service.sessions[tenant.session_id].append(model_id)
        ops = tenant.oplog.read()
        if ops.state is not None:
            tenant.build(service.base_dir(state), state.engine.device)
            tenant.restore(ops.state)
        service.work.open(model_id, first_seq=ops.state_seq + 1)
        for done in ops.done.values():
            service.futures.create(done["rid"])
            service.futures.settle(done["rid"], decode_result(done))
        again = 0
        for seq in sorted(ops.submits):
            sub = ops.submits[seq]
            rid, digest, kind = sub["rid"], sub["digest"], sub["kind"]
            if seq <= ops.state_seq:
                service.work.remember(model_id, seq, digest, rid)
                continue
            done = seq in ops.done
            if kind == "refused" or (done and kind in DONE_FOR_GOOD):
                service.work.submit(model_id, seq, digest, None, rid=rid)
                continue
            try:
                _resubmit(service, kind, tenant.oplog.body(seq), digest, Replay(rid, done))
            except (TinkerRequestError, ValidationError) as exc:  # e.g. the checkpoint it
                # loads was deleted, or settings this version refuses
                service.work.submit(model_id, seq, digest, None, rid=rid)
                service.futures.fail(rid, str(exc))
            again += 1
        log.info("%s: recovered at seq_id %d, %d ops run again", model_id, ops.state_seq, again)


def _resubmit(service: TinkerService, kind: str, body: bytes, digest: str, replay: Replay) -> None:
    if kind == "forward_backward":
        inp = check_forward_backward(
            parse_forward_backward(body),
            vocab=service.vocab,
            max_len=service.config.max_model_len,
            max_datums=service.limits.max_datums,
        )
        service.forward_backward(inp, digest, body, replay)
        return
    schema, handle = {
        "create": (CreateModelRequest, service.create_model),
        "optim_step": (OptimStepRequest, service.optim_step),
        "save_weights": (SaveWeightsRequest, service.save_weights),
        "save_weights_for_sampler": (SaveForSamplerRequest, service.save_for_sampler),
        "load_weights": (LoadWeightsRequest, service.load_weights),
    }[kind]
    handle(schema.model_validate_json(body), digest, body, replay)
