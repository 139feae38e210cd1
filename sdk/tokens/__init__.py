"""Tokens in, tokens out: exact incremental prompts and response parsing on real chat templates.

- `ChatRenderer` / `Conversation`: each prompt is the previous prompt + the sampled ids
  verbatim + a delta rendered in a bounded synthetic context, so a turn costs O(new messages).
  A probe per template key (template text, kwargs, tools, system message) decides when that is
  exact; otherwise the prompt is fully re-rendered and the `Fallback` says why.
- `TemplateChoice`: which chat template a renderer renders with (`template="auto"` swaps in
  TRL's prefix-preserving `_training` variant when the model's own is not prefix-preserving).
- `ResponseParser` / `ParsedResponse`: sampled ids to content, reasoning and tool calls with
  transformers' `parse_response` and the response template known for the exact chat template.
- `PromptDelta`: what a recorder stores per turn (`Turn.from_completion(delta, completion)`).
- `renderer.statistics()`: how often the renderer's memos served a step or a parse from memory.
- `plies doctor` reports whether a template is safe for incremental prompts.

Example::

    from plies.tokens import ChatRenderer

    renderer = ChatRenderer(tokenizer, tools=[weather_schema])   # one per model
    renderer.choice                               # TemplateChoice: e.g. TRL's qwen3_training
    conv = renderer.start([{"role": "user", "content": "Weather in Paris?"}])
    prompt = await conv.arender()                 # full render on the first turn
    ids, finish = sample(prompt)                  # your policy client, stop token kept
    parsed = conv.add_completion(ids, finish)     # parsed.tool_calls, parsed.ill_formed
    conv.add_messages([{"role": "tool", "name": "weather", "content": "18C"}])
    prompt = await conv.arender()                 # previous prompt + ids + delta
    d = conv.delta                                # d.ids, d.extends, d.fallback
    conv.fallbacks                                # [Fallback(turn, reason, detail), ...]

See docs/tito.md for the guarantees and the pitfalls per model family.
"""

from .._exports import name_after as _name_after
from ._choice import TemplateChoice as TemplateChoice
from ._parser import ParsedResponse as ParsedResponse
from ._parser import ResponseParser as ResponseParser
from ._probe import FallbackReason as FallbackReason
from ._renderer import ChatRenderer as ChatRenderer
from ._renderer import Conversation as Conversation
from ._renderer import PromptDelta as PromptDelta

__all__ = [
    "ChatRenderer",
    "Conversation",
    "FallbackReason",
    "ParsedResponse",
    "PromptDelta",
    "ResponseParser",
    "TemplateChoice",
]

_name_after(__name__, globals())
