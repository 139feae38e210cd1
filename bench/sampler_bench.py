"""Reference server throughput against transformers `generate`, measured side by side.

Starts `plies serve` on the tiny model, batched and then `--batch-invariant` (every request
decoded alone, so its logprobs are reproducible bit for bit), samples at concurrency 1, 8 and
32 through `VLLMClient`, then runs transformers `generate` one request at a time on the same
model, the same prompts and the same number of new tokens, and prints tokens/s, the ratios
to `generate`, and what batch invariance costs at each concurrency.

    python bench/sampler_bench.py [--tokens 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import anyio
import torch
from transformers import AutoModelForCausalLM

from plies.policy import SamplingParams, Timeout, VLLMClient
from plies.testing import plies_command, serve_process_sync, tiny_model_dir

LEVELS = (1, 8, 32)
MODES = {"batched": (), "--batch-invariant": ("--batch-invariant",)}
"""The server's two sampling modes, by the flags that select them."""


def prompts(n: int) -> list[list[int]]:
    """Distinct prompts of 12 to 27 tokens (chat-shaped: im_start user ... assistant)."""
    return [[151644, 872, 198] + [1000 + 37 * i + j for j in range(9 + i % 16)] for i in range(n)]


async def server_rate(url: str, model: str, concurrency: int, tokens: int) -> float:
    batch = prompts(max(concurrency, 4))
    params = SamplingParams(max_tokens=tokens, temperature=1.0)
    produced = 0
    async with VLLMClient(url, model, timeout=Timeout(read=600)) as client:
        await client.sample(batch[0], SamplingParams(max_tokens=2))  # warm up
        limiter = anyio.CapacityLimiter(concurrency)

        async def one(p: list[int]) -> None:
            nonlocal produced
            async with limiter:
                n = len((await client.sample(p, params)).ids)
            produced += n  # not `produced += await ...`: that reads `produced` before awaiting

        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for p in batch:
                tg.start_soon(one, p)
        return produced / (time.perf_counter() - start)


def generate_rate(model_dir, tokens: int, n: int) -> float:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    produced = 0
    with torch.inference_mode():
        model.generate(torch.tensor([prompts(1)[0]]), max_new_tokens=2, do_sample=True)
        start = time.perf_counter()
        for p in prompts(n):
            out = model.generate(
                torch.tensor([p]),
                max_new_tokens=tokens,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                pad_token_id=model.config.pad_token_id,
            )
            produced += out.shape[1] - len(p)
    return produced / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--threads", type=int, default=1, help="torch threads, both sides")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = tiny_model_dir()
    rates: dict[str, dict[int, float]] = {}
    for mode, flags in MODES.items():
        with tempfile.TemporaryDirectory() as tmp:
            cmd = plies_command("serve", str(model_dir), "--state-dir", str(Path(tmp) / "state"))
            cmd += ["--threads", str(args.threads), *flags]
            with serve_process_sync(cmd, log=Path(tmp) / "serve.log") as server:
                rates[mode] = {
                    c: anyio.run(server_rate, server.url, server.ready["model"], c, args.tokens)
                    for c in LEVELS
                }
    baseline = generate_rate(model_dir, args.tokens, 4)
    print(f"tiny Qwen3, {args.tokens} new tokens per request, {args.threads} torch thread(s)")
    print(f"{'sampler':<48}{'tokens/s':>10}{'vs generate':>14}")
    print(f"{'transformers generate, one at a time':<48}{baseline:>10.1f}{1.0:>13.2f}x")
    for mode, by_level in rates.items():
        for c, rate in by_level.items():
            name = f"plies serve {mode}, concurrency {c}"
            print(f"{name:<48}{rate:>10.1f}{rate / baseline:>13.2f}x")
    for c in LEVELS:
        cost = rates["batched"][c] / rates["--batch-invariant"][c]
        print(f"concurrency {c}: batched / batch-invariant tokens/s = {cost:.2f}x")


if __name__ == "__main__":
    main()
