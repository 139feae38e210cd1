"""The reference policy server: sampling (and training) on one machine, no accelerator needed.

`plies serve MODEL_DIR` runs a transformers causal LM behind the subset of vLLM's HTTP API that
`plies.policy.VLLMClient` speaks, so the same client code works against this server on a laptop
and against vLLM or SGLang fleets at scale.

Contract (other parts of plies build on it):

- `create_app(config) -> FastAPI` is the only way to get an app; there is no module-level app.
  `ServerConfig` holds `model_dir`, `state_dir`, `host`, `port`, the batching knobs
  (`max_batch_size`, `max_queued`), `max_model_len`, `device` and the `TrainerConfig`.
  The factory builds every router from functions (sampling, training, and, only with the
  test-only `create_app(config, test_faults=True)` / `plies serve --test-faults`, the fault
  routes that hold the trainer at a point so tests can crash it there).
- `plies serve MODEL_DIR [--state-dir DIR] [--host 127.0.0.1] [--port 0]` binds loopback by
  default, logs to stderr, and prints exactly one JSON line on stdout when ready::

      {"url": "http://127.0.0.1:PORT", "policy": {<PolicyRef>}, "model": "policy-0"}

  `policy` is the current (latest published) policy and `model` its served name.
- The door (`_guard.py`, for every route alike): with `--token` / `PLIES_TOKEN` every request
  but `/health` needs `Authorization: Bearer <token>` (or `X-API-Key`); a `--host` beyond
  loopback without a token is refused at start. Bodies are capped (413), zstd bodies are
  decompressed under the same cap off the loop, and a client that disconnects cancels its
  completion. Paths given to `/v1/load_lora_adapter` must resolve
  inside the state dir or an `--allow-path`, and the weights must match the digest their
  `policy.json` names. The threat model is in docs/operations.md.
- Policy store (`PolicyStore`): published policies are immutable directories
  `STATE_DIR/policies/<version>/` in Hugging Face format (config, model.safetensors, tokenizer
  files) plus `policy.json` holding the `PolicyRef` (uri = `file://` URI of that directory,
  version, digest = `sha256:` + sha256 over the safetensors weight files). Version 0 is a copy of
  MODEL_DIR. A version is written to a temporary directory and renamed into place, never
  overwritten. `PolicyStore.publish(model, tokenizer) -> PolicyRef` writes the next version;
  `PolicyStore.read_ref(path)` reads the `PolicyRef` of a published directory. Reopening a state
  dir finds what was published; the server then serves the latest version.
- Served names: version k of the store is served as
  `plies.wire.sampling.served_name(k) == "policy-k"`, the one naming rule that clients share.
  A completion request names its policy with `model`; several policies are served at once,
  so an episode started on version k can finish on k while new episodes start on k + 1. Every
  completion response carries `plies_policy`, the `PolicyRef` of the weights that produced it,
  and `/v1/models` lists each served name with its `plies_policy`.
- Loading and unloading, shaped like vLLM's LoRA endpoints, but taking a *published policy
  directory* (full weights), not an adapter:
  `POST /v1/load_lora_adapter {"lora_name": "policy-3", "lora_path": "<published dir>"}` and
  `POST /v1/unload_lora_adapter {"lora_name": "policy-2"}`. In process, the same operations are
  `await Engine.load(name, path) -> PolicyRef` and `Engine.unload(name)`.
- Shared state for routes: `server_state(request) -> ServerState(config, store, engine,
  tokenizer)`, in its own module so that routers never import the app factory.
- Wire schemas: the request and response models are `plies.wire.sampling` and
  `plies.wire.training`, shared with the clients; the server imports no client package.
- Logprob convention (shared with training): the logprob of each sampled token under the
  distribution it was sampled from: logits / temperature, then top-k, then top-p (both as
  masks, then renormalised by the softmax). `processed_logprobs` computes exactly that, so the
  trainer can compute the same quantity. At temperature 0 (greedy) the logprob is that of the
  raw logits (as vLLM's `--logprobs-mode processed_logprobs` reports it).
- `POST /generate` speaks SGLang's native subset (`input_ids`, `return_logprob`), sampling
  from the policy served under `lora_path` (SGLang's adapter name; without one, the most
  recently loaded policy) and reports its version as `meta_info.weight_version`.
- `GET /plies/stats` returns the engine's counters (forward passes, rows per pass, requests).
- The Tinker API (`/api/v1/`, the private `_tinker` package, mounted when the `tinker` SDK
  is installed): the unmodified `tinker==0.38.0` SDK trains tenants (one per `create_model`,
  LoRA or full weights) and samples from their snapshots on the same engine; `plies serve
  --model-name NAME` names the base model there. See docs/tinker.md.
"""

from .._exports import name_after as _name_after
from ._app import create_app as create_app
from ._config import ServerConfig as ServerConfig
from ._config import TrainerConfig as TrainerConfig
from ._policies import PolicyStore as PolicyStore
from ._sampling import processed_logprobs as processed_logprobs

__all__ = [
    "PolicyStore",
    "ServerConfig",
    "TrainerConfig",
    "create_app",
    "processed_logprobs",
]

_name_after(__name__, globals())
