"""Sampling routes: vLLM's `/v1/completions` subset, SGLang's `/generate`, policy loading.

Both sampling routes name the policy they sample from (`model`; `lora_path` on `/generate`,
where a missing name means the newest loaded policy, as on an SGLang engine), and every
answer carries the `PolicyRef` of the weights that produced it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Awaitable
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import anyio
from fastapi import APIRouter, Request, Response
from starlette.types import Receive, Scope, Send
from tokenizers.decoders import DecodeStream

from ..wire.sampling import (
    CompletionRequest,
    GenerateRequest,
    LoadPolicyRequest,
    ModelCard,
    UnloadPolicyRequest,
)
from ._engine import GenerateParams, UnknownPolicy
from ._policies import PolicyStore, confine
from ._state import server_state

__all__ = ["sampling_router"]

T = TypeVar("T")

_CLIENT_GONE = 499
"""The status of an answer to a client that left: nobody reads it (nginx's code)."""


async def _unless_client_leaves(request: Request, work: Awaitable[T]) -> T | None:
    """`await work`, cancelled (None) when the client disconnects first.

    Starlette does not cancel a handler whose client left, so without this a request the
    client gave up on (a timeout, a gateway turn cut off) would decode to the end for nobody.
    Cancelling `Engine.generate` drops its row at the next step. The body was read already,
    so the next message `receive` gives is the disconnect.
    """
    done: list[T] = []
    failure: Exception | None = None
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        try:
            done.append(await work)
        except Exception as exc:  # raised below, outside the group, as itself
            failure = exc
        tg.cancel_scope.cancel()
    if failure is not None:
        raise failure
    return done[0] if done else None


def _envelope(body: CompletionRequest) -> dict[str, Any]:
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.model,
    }


def _choice(
    body: CompletionRequest, tok: Any, text: str, ids: list[int], logprobs: list[float]
) -> dict[str, Any]:
    """A completion choice (or a streamed chunk's) for these ids, as the request asked."""
    lp_block = None
    if body.logprobs is not None:
        if body.return_tokens_as_token_ids:
            tokens = [f"token_id:{t}" for t in ids]
        else:
            tokens = tok.convert_ids_to_tokens(ids)
        lp_block = {
            "tokens": tokens,
            "token_logprobs": logprobs,
            "top_logprobs": None,
            "text_offset": None,
        }
    choice: dict[str, Any] = {
        "index": 0,
        "text": text,
        "logprobs": lp_block,
        "finish_reason": None,
        "stop_reason": None,
    }
    if body.return_token_ids:
        choice["token_ids"] = ids
    return choice


class _StreamedCompletion(Response):
    """`/v1/completions` with `stream: true`, as vLLM streams it: a server-sent event per
    decode step with that step's text, token ids and logprobs, the last one with the finish
    reason (and plies' `plies_policy`), then `[DONE]`.

    The stream opens with the first sampled tokens, so a request the engine refuses (an
    unknown policy, a prompt too long) still gets its HTTP error. A client that leaves
    cancels the request (`_unless_client_leaves`).
    """

    def __init__(self, request: Request, body: CompletionRequest, params: GenerateParams):
        self.request = request
        self.body = body
        self.params = params
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body, state = self.body, server_state(self.request)
        tok = state.tokenizer
        envelope = _envelope(body)
        text = DecodeStream(skip_special_tokens=body.skip_special_tokens)
        started = False

        async def emit(record: dict[str, Any]) -> None:
            nonlocal started
            if not started:
                headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                started = True
            data = b"data: " + json.dumps(record, ensure_ascii=False).encode() + b"\n\n"
            await send({"type": "http.response.body", "body": data, "more_body": True})

        async def on_tokens(ids: list[int], logprobs: list[float]) -> None:
            pieces = (text.step(tok.backend_tokenizer, t) for t in ids)
            choice = _choice(body, tok, "".join(p for p in pieces if p), ids, logprobs)
            await emit({**envelope, "choices": [choice]})

        work = state.engine.generate(body.model, body.prompt, self.params, on_tokens=on_tokens)
        result = await _unless_client_leaves(self.request, work)
        if result is None:
            return
        last = _choice(body, tok, "", [], [])
        last |= {"finish_reason": result.finish_reason, "stop_reason": result.stop_reason}
        policy = result.policy.model_dump(mode="json")
        await emit({**envelope, "choices": [last], "plies_policy": policy})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def sampling_router() -> APIRouter:
    """The sampling, loading and statistics routes, over the app's engine and store."""
    router = APIRouter()

    @router.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @router.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        state = server_state(request)
        cards = [
            ModelCard(id=name, root=ref.uri, plies_policy=ref).model_dump(mode="json")
            for name, ref in state.engine.served().items()
        ]
        return {"object": "list", "data": cards}

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        state = server_state(request)
        params = GenerateParams(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k if body.top_k and body.top_k > 0 else -1,
            seed=body.seed,
            stop_token_ids=frozenset(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
        )
        if body.stream:
            state.engine.check(body.model, body.prompt, params)
            return _StreamedCompletion(request, body, params)
        result = await _unless_client_leaves(
            request, state.engine.generate(body.model, body.prompt, params)
        )
        if result is None:
            return Response(status_code=_CLIENT_GONE)
        text = state.tokenizer.decode(result.ids, skip_special_tokens=body.skip_special_tokens)
        choice = _choice(body, state.tokenizer, text, result.ids, result.logprobs)
        choice |= {"finish_reason": result.finish_reason, "stop_reason": result.stop_reason}
        if body.return_token_ids:
            choice["prompt_token_ids"] = body.prompt
        n_out = len(result.ids)
        return {
            **_envelope(body),
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(body.prompt),
                "completion_tokens": n_out,
                "total_tokens": len(body.prompt) + n_out,
            },
            "plies_policy": result.policy.model_dump(mode="json"),
        }

    @router.post("/generate")
    async def generate(body: GenerateRequest, request: Request) -> Any:
        state = server_state(request)
        name = body.lora_path
        if name is None:
            served = state.engine.served()
            if not served:
                raise UnknownPolicy("no policy is loaded")
            name = list(served)[-1]
        sp = body.sampling_params
        params = GenerateParams(
            max_tokens=sp.max_new_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k if sp.top_k > 0 else -1,
            seed=sp.sampling_seed,
            stop_token_ids=frozenset(sp.stop_token_ids or ()),
            ignore_eos=sp.ignore_eos,
        )
        result = await _unless_client_leaves(
            request, state.engine.generate(name, body.input_ids, params)
        )
        if result is None:
            return Response(status_code=_CLIENT_GONE)
        ids = result.ids
        if result.finish_reason == "stop" and not sp.no_stop_trim:
            ids = ids[:-1]
        meta: dict[str, Any] = {
            "id": uuid.uuid4().hex,
            "finish_reason": {
                "type": result.finish_reason,
                "matched": result.ids[-1] if result.finish_reason == "stop" else None,
            },
            "prompt_tokens": len(body.input_ids),
            "completion_tokens": len(result.ids),
            "weight_version": str(result.policy.version),
        }
        if body.return_logprob:
            meta["output_token_logprobs"] = [
                [lp, t, None] for t, lp in zip(result.ids, result.logprobs, strict=True)
            ]
        return {
            "text": state.tokenizer.decode(ids, skip_special_tokens=sp.skip_special_tokens),
            "output_ids": result.ids,
            "meta_info": meta,
        }

    @router.post("/v1/load_lora_adapter")
    async def load_policy(body: LoadPolicyRequest, request: Request) -> dict[str, Any]:
        state = server_state(request)
        roots = [state.config.state_dir, *state.config.allow_paths]
        path = confine(Path(body.lora_path), roots)
        await anyio.to_thread.run_sync(PolicyStore.verify, path)
        ref = await state.engine.load(body.lora_name, path, replace=body.load_inplace)
        return {"status": "loaded", "name": body.lora_name, "plies_policy": ref.model_dump()}

    @router.post("/v1/unload_lora_adapter")
    async def unload_policy(body: UnloadPolicyRequest, request: Request) -> dict[str, Any]:
        ref = server_state(request).engine.unload(body.lora_name)
        return {"status": "unloaded", "name": body.lora_name, "plies_policy": ref.model_dump()}

    @router.get("/plies/stats")
    async def stats(request: Request) -> dict[str, Any]:
        return asdict(server_state(request).engine.statistics())

    @router.get("/plies/policies")
    async def policies(request: Request) -> dict[str, Any]:
        store = server_state(request).store
        refs = [store.get(v).model_dump() for v in store.versions()]
        return {"published": refs}

    return router
