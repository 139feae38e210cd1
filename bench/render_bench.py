"""Prompt-building cost: incremental ChatRenderer against full re-rendering, side by side.

A 200-turn tool-calling episode on the offline Qwen3 tokenizer. Each turn adds one assistant
tool call (with reasoning, so Qwen3 keeps it in history) and one tool result. Both paths build
every turn's prompt in the same run; each turn's CPU time is the median over repeats.

Targets: incremental total <= 1/20 of full; turn 200 <= 1.5x turn 10 (incremental).

Then a key whose probe verdict says every turn falls back (Qwen3's own template with
enable_thinking=False drops the prefill from history): each of its turns should cost what a
bare full render costs, not a refused synthetic render on top. Target: <= 1.1x.

    python bench/render_bench.py [--turns 200] [--repeats 7] [--template qwen3|qwen3_training]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from transformers import AutoTokenizer

from plies.testing import qwen3_tokenizer_dir
from plies.tokens import ChatRenderer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
START = [
    {"role": "system", "content": "You are a weather agent. Call tools one city at a time."},
    {"role": "user", "content": "Report the weather for every city on my list."},
]


def episode(turns: int) -> list[tuple[dict, dict]]:
    steps = []
    for k in range(turns):
        city = f"City{k:03d}"
        message = {
            "role": "assistant",
            "content": "",
            "reasoning_content": f"Next on the list is {city}; I will look it up.",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": city}},
                }
            ],
        }
        result = {"role": "tool", "name": "get_weather", "content": f"{city}: {10 + k % 20}C"}
        steps.append((message, result))
    return steps


def sampled_ids(tok, message: dict) -> list[int]:
    """The template's ids for one tool-loop turn, taken from a short render (O(1) per turn)."""
    head = [
        *START,
        {"role": "assistant", "content": "", "tool_calls": message["tool_calls"]},
        {"role": "tool", "name": "get_weather", "content": "x"},
    ]
    prompt = tok.apply_chat_template(
        head, tools=[WEATHER], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    ids = tok.apply_chat_template(
        [*head, message], tools=[WEATHER], tokenize=True, return_dict=False
    )
    end = tok.convert_tokens_to_ids("<|im_end|>")
    return ids[len(prompt) : ids.index(end, len(prompt)) + 1]


def run_incremental(renderer, steps, completions) -> tuple[list[float], list[int], int]:
    clock = time.thread_time
    conv = renderer.start(START)
    conv.render()
    costs, lengths = [], []
    for (message, result), ids in zip(steps, completions, strict=True):
        t0 = clock()
        conv.add_completion(ids, message=message)
        conv.add_messages([result])
        prompt = conv.render()
        costs.append(clock() - t0)
        lengths.append(len(prompt))
    return costs, lengths, len(conv.fallbacks)


def run_full(tok, steps, completions, **kwargs) -> tuple[list[float], list[int]]:
    clock = time.thread_time
    history = list(START)
    costs, lengths = [], []
    for message, result in steps:
        t0 = clock()
        history += [message, result]
        prompt = tok.apply_chat_template(
            history,
            tools=[WEATHER],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            **kwargs,
        )
        costs.append(clock() - t0)
        lengths.append(len(prompt))
    return costs, lengths


def refused_key(tok, turns: int, repeats: int) -> None:
    """Per-turn cost on a key the probe says always falls back, against a bare full render."""
    nothink = {"enable_thinking": False}
    steps = [({**m, "reasoning_content": None}, r) for m, r in episode(turns)]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>'
    end = tok.convert_tokens_to_ids("<|im_end|>")
    completions = [
        [*tok.encode(call % m["tool_calls"][0]["function"]["arguments"]["city"]), end]
        for m, _ in steps
    ]
    renderer = ChatRenderer(tok, tools=[WEATHER], template_kwargs=nothink, template="model")
    run_incremental(renderer, steps[:3], completions[:3])
    inc_runs, full_runs = [], []
    for _ in range(repeats):
        inc, inc_len, fallbacks = run_incremental(renderer, steps, completions)
        full, full_len = run_full(tok, steps, completions, **nothink)
        assert inc_len == full_len and fallbacks == turns
        inc_runs.append(sum(inc))
        full_runs.append(sum(full))
    inc_total, full_total = statistics.median(inc_runs), statistics.median(full_runs)
    ratio = inc_total / full_total
    print(
        f"refused key (qwen3, enable_thinking=False, template='model'), {turns} turns, "
        f"fallbacks {fallbacks}: renderer {inc_total * 1e3:.1f} ms, bare full renders "
        f"{full_total * 1e3:.1f} ms"
    )
    print(
        f"renderer / bare full render   = {ratio:.2f}  (target <= 1.1) "
        f"{'PASS' if ratio <= 1.1 else 'MISS'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--template", default="qwen3", help="a TRL template name, e.g. qwen3")
    args = parser.parse_args()

    tok = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    import trl

    tok.chat_template = (
        Path(trl.__file__).parent / "chat_templates" / f"{args.template}.jinja"
    ).read_text()
    steps = episode(args.turns)
    completions = [sampled_ids(tok, m) for m, _ in steps]
    renderer = ChatRenderer(tok, tools=[WEATHER], template="model")  # the template benched
    t0 = time.thread_time()
    run_incremental(renderer, steps[:3], completions[:3])  # probe once, compile the template
    probe_s = time.thread_time() - t0

    inc_runs, full_runs = [], []
    for _ in range(args.repeats):  # interleaved, so drift hits both paths alike
        inc, inc_len, fallbacks = run_incremental(renderer, steps, completions)
        full, full_len = run_full(tok, steps, completions)
        assert inc_len == full_len, "incremental and full prompts differ in length"
        inc_runs.append(inc)
        full_runs.append(full)
    inc_turn = [statistics.median(c) for c in zip(*inc_runs, strict=True)]
    full_turn = [statistics.median(c) for c in zip(*full_runs, strict=True)]
    inc_total, full_total = sum(inc_turn), sum(full_turn)
    t10, tn = inc_turn[9], inc_turn[-1]
    ratio_total = inc_total / full_total
    ratio_turn = tn / t10
    print(
        f"template {args.template}, {args.turns} turns, {args.repeats} repeats, "
        f"final prompt {inc_len[-1]} tokens, fallbacks {fallbacks}"
    )
    print(f"probe + first render (once per template key): {probe_s * 1e3:.1f} ms")
    print(
        f"incremental total {inc_total * 1e3:8.1f} ms   "
        f"full re-render total {full_total * 1e3:8.1f} ms"
    )
    print(
        f"incremental / full total      = {ratio_total:.4f}  "
        f"(1/{1 / ratio_total:.0f}; target <= 1/20) "
        f"{'PASS' if ratio_total <= 1 / 20 else 'MISS'}"
    )
    print(
        f"incremental turn {args.turns} / turn 10 = {ratio_turn:.2f}  "
        f"({tn * 1e3:.3f} ms vs {t10 * 1e3:.3f} ms; target <= 1.5) "
        f"{'PASS' if ratio_turn <= 1.5 else 'MISS'}"
    )
    print(
        f"full turn {args.turns} / turn 10        = {full_turn[-1] / full_turn[9]:.2f}  "
        f"(for contrast)"
    )
    refused_key(tok, min(args.turns, 20), args.repeats)


if __name__ == "__main__":
    main()
