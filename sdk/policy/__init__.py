"""Policy clients: token ids in, sampled ids, logprobs and the producing policy out.

- `SamplingParams`, `Completion`, and the `PolicyClient` protocol (`sample`);
  `StreamingPolicyClient` (`sample_streaming`, telling a callback the ids as they come),
  which `VLLMClient` is, for vLLM and `plies serve`.
- `VLLMClient`: vLLM's `/v1/completions`; also the client of the plies reference server.
- `SGLangClient`: SGLang's native `/generate`.
- `TinkerPolicyClient`: any Tinker-API service, through the `tinker` SDK (`plies[tinker]`);
  each published `tinker://` policy is its own sampler.
- `Timeout`: explicit HTTP timeouts (the retry bounds are `plies.RetryPolicy`).
- `SeededPolicy`: seeds every request of an episode from the episode id and the prompt
  length, so a recorded turn can be re-sampled exactly (`plies replay`).
- `SESSION_HEADER`: the header (`X-Session-ID`) that carries `sample(session=...)`, the
  episode id, to a router in front of many engines.
- Publication: `publish(policy, loaders)` makes a saved policy servable on each
  `PolicyLoader` (a `VLLMClient` loads it under `served_name(version)` on every engine of its
  fleet, and `unload_policy` frees it; `ReloadInPlace` swaps the weights behind one name),
  keeping the client's name -> `PolicyRef` map in step.

Logprob convention: each sampled token's logprob under the distribution it was drawn from
(logits / temperature, then top-k, then top-p), vLLM's `processed_logprobs`.
"""

from .._exports import name_after as _name_after
from ._config import Timeout as Timeout
from ._http import SESSION_HEADER as SESSION_HEADER
from ._publish import ReloadInPlace as ReloadInPlace
from ._publish import publish as publish
from ._seeded import SeededPolicy as SeededPolicy
from ._sglang import SGLangClient as SGLangClient
from ._tinker import TinkerPolicyClient as TinkerPolicyClient
from ._types import Completion as Completion
from ._types import PolicyClient as PolicyClient
from ._types import PolicyLoader as PolicyLoader
from ._types import SamplingParams as SamplingParams
from ._types import StreamingPolicyClient as StreamingPolicyClient
from ._vllm import VLLMClient as VLLMClient

__all__ = [
    "SESSION_HEADER",
    "Completion",
    "PolicyClient",
    "PolicyLoader",
    "ReloadInPlace",
    "SGLangClient",
    "SamplingParams",
    "SeededPolicy",
    "StreamingPolicyClient",
    "Timeout",
    "TinkerPolicyClient",
    "VLLMClient",
    "publish",
]

_name_after(__name__, globals())
