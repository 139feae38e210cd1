"""Protobuf in and out: `forward_backward` requests, its outputs and sample responses.

The messages are the SDK's own generated module (`tinker.proto.tinker_public_pb2`), imported,
never copied: the wire is private to the SDK and pinned with it. Everything a request carries
is checked here (shapes, dtypes, token ids, finiteness), so the trainer sees only data it can
train on and a bad request becomes a 400 before it takes a `seq_id` slot's work.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from .._quote import quoted
from ._errors import TinkerRequestError

__all__ = [
    "LOSS_INPUTS",
    "MASK_LOGPROB",
    "MAX_RESULT_BYTES",
    "SUPPORTED_LOSSES",
    "ForwardBackwardInput",
    "PromptScores",
    "TinkerDatum",
    "check_forward_backward",
    "encode_forward_backward",
    "encode_samples",
    "parse_forward_backward",
]

LOSS_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens",),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "dro": ("target_tokens", "logprobs", "advantages"),
}
"""The losses this slice computes and the `loss_fn_inputs` each one requires."""

SUPPORTED_LOSSES = tuple(LOSS_INPUTS)

_OPTIONAL_INPUTS = {"weights", "clip_low_threshold", "clip_high_threshold"}

_CLIP = {"clip_low_threshold", "clip_high_threshold"}
_CONFIG_KEYS: dict[str, set[str]] = {"ppo": _CLIP, "cispo": _CLIP, "dro": {"beta"}}
"""The `loss_fn_config` keys each loss reads; any other key is refused."""

_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


@dataclass
class TinkerDatum:
    """One sequence: input tokens and its loss inputs, each of leading dimension T."""

    tokens: np.ndarray  # (T,) int64
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class ForwardBackwardInput:
    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float]
    forward_only: bool
    data: list[TinkerDatum]


MAX_RESULT_BYTES = 16 << 20
"""The largest forward_backward answer: one float32 logprob per target position, summed over
the request's datums. It is held as a future and journaled in the tenant's op log (base64),
so the target shapes are checked against it before anything is built: a sparse tensor's
shape is not bounded by its bytes (a 185-byte request can declare [7, 2^24])."""


@dataclass
class _Budget:
    """The answer bytes a request's target tensors may still declare."""

    result_bytes: int = MAX_RESULT_BYTES

    def take(self, size: int, where: str) -> None:
        self.result_bytes -= 4 * size
        if self.result_bytes < 0:
            raise TinkerRequestError(
                f"{where}: the answer (one float32 per target position) would exceed "
                f"{MAX_RESULT_BYTES} bytes; send fewer datums or fewer targets per position"
            )


def _shape(msg: pb.Tensor, where: str, rows: int, vocab: int) -> list[int]:
    """The declared shape, if it is [rows] or [rows, K] with 1 <= K <= vocab."""
    if len(msg.shape) not in (1, 2):
        raise TinkerRequestError(
            f"{where}: a tensor of {len(msg.shape)} dimensions is not [T] or [T, K]"
        )
    shape = [int(s) for s in msg.shape]
    if shape[0] != rows:
        raise TinkerRequestError(f"{where}: has {shape[0]} rows for {rows} input tokens")
    if len(shape) == 2 and not 1 <= shape[1] <= vocab:
        raise TinkerRequestError(
            f"{where}: shape {shape} has K = {shape[1]}, outside [1, {vocab}] (the vocabulary)"
        )
    return shape


def _tensor(msg: pb.Tensor, where: str, shape: list[int]) -> np.ndarray:
    """The tensor `msg` holds, built only once its declared shape is known to be `shape`
    (checked by the caller against the datum, the vocabulary and the request's budget)."""
    dtype = _NUMPY.get(msg.dtype)
    if dtype is None:
        raise TinkerRequestError(f"{where}: unsupported dtype {msg.dtype}")
    if list(msg.shape) != shape:
        raise TinkerRequestError(f"{where}: has shape {list(msg.shape)}, expected {shape}")
    rows = shape[0]
    size = int(np.prod(shape))
    try:
        if msg.HasField("sparse_csr"):
            csr = msg.sparse_csr
            values = np.frombuffer(csr.values, dtype=dtype)
            crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
            col = np.frombuffer(csr.col_indices, dtype=np.int64)
            if len(shape) != 2:
                raise TinkerRequestError(f"{where}: a sparse tensor must be 2-D, got {shape}")
            cols = shape[1]
            if len(crow) != rows + 1 or crow[0] != 0 or np.any(np.diff(crow) < 0):
                raise TinkerRequestError(f"{where}: malformed CSR row index")
            if crow[-1] != len(values) or len(col) != len(values):
                raise TinkerRequestError(f"{where}: CSR index and value counts disagree")
            if np.any((col < 0) | (col >= cols)):
                raise TinkerRequestError(f"{where}: CSR column index out of range")
            dense = np.zeros((rows, cols), dtype=dtype)
            dense[np.repeat(np.arange(rows), np.diff(crow)), col] = values
            array = dense.reshape(shape)
        else:
            array = np.frombuffer(msg.dense, dtype=dtype)
            if array.size != size:
                raise TinkerRequestError(
                    f"{where}: {array.size} values for shape {shape} ({size} expected)"
                )
            array = array.reshape(shape)
    except ValueError as exc:  # a byte count that is not a whole number of elements
        raise TinkerRequestError(f"{where}: {exc}") from None
    if array.dtype.kind == "f" and not np.all(np.isfinite(array)):
        raise TinkerRequestError(f"{where}: holds a non-finite number")
    return array


def _datum(
    msg: pb.Datum, k: int, loss_fn: str, vocab: int, max_len: int, budget: _Budget
) -> TinkerDatum:
    parts = []
    for chunk in msg.model_input:
        if chunk.WhichOneof("chunk") != "encoded_text":
            raise TinkerRequestError(
                f"datum {k}: only encoded_text input chunks are supported (no images or audio)"
            )
        try:
            parts.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
        except ValueError:
            raise TinkerRequestError(f"datum {k}: token bytes are not int32") from None
    tokens = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
    n = len(tokens)
    if n == 0:
        raise TinkerRequestError(f"datum {k}: model_input holds no tokens")
    if n > max_len:
        raise TinkerRequestError(f"datum {k}: {n} tokens exceed max_model_len {max_len}")
    needed = LOSS_INPUTS[loss_fn]
    names = set(msg.loss_fn_inputs)
    missing = [name for name in needed if name not in names]
    if missing:
        raise TinkerRequestError(f"datum {k}: {loss_fn} needs loss_fn_inputs {missing}")
    unknown = sorted(names - set(needed) - _OPTIONAL_INPUTS)
    if unknown:
        shown = ", ".join(quoted(name) for name in unknown[:8])
        raise TinkerRequestError(f"datum {k}: {loss_fn} does not take loss_fn_inputs [{shown}]")
    where = f"datum {k} loss_fn_inputs['target_tokens']"
    target_shape = _shape(msg.loss_fn_inputs["target_tokens"], where, n, vocab)
    if len(target_shape) == 2 and loss_fn != "cross_entropy":
        raise TinkerRequestError(f"datum {k}: only cross_entropy takes [T, K] target_tokens")
    budget.take(int(np.prod(target_shape)), where)
    inputs = {}
    for name in sorted(names, key=lambda name: name != "target_tokens"):
        want = target_shape if name in ("target_tokens", "weights") else target_shape[:1]
        where = f"datum {k} loss_fn_inputs[{name!r}] (T = {n} input tokens)"
        inputs[name] = _tensor(msg.loss_fn_inputs[name], where, want)
    target = inputs["target_tokens"].astype(np.int64)
    for name, ids in (("model_input", tokens), ("target_tokens", target)):
        bad = ids[(ids < 0) | (ids >= vocab)]
        if bad.size:
            raise TinkerRequestError(
                f"datum {k}: {name} token id {int(bad[0])} is outside the vocabulary [0, {vocab})"
            )
    inputs["target_tokens"] = target
    return TinkerDatum(tokens, inputs)


def parse_forward_backward(body: bytes) -> pb.ForwardBackwardRequest:
    """Parse a `ForwardBackwardRequest`; its contents are checked by `check_forward_backward`.

    Raises:
        TinkerRequestError: the bytes are not the message, or it names no model.
    """
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as exc:
        raise TinkerRequestError(f"malformed ForwardBackwardRequest protobuf: {exc}") from None
    if not msg.model_id:
        raise TinkerRequestError("ForwardBackwardRequest has no model_id")
    return msg


def check_forward_backward(
    msg: pb.ForwardBackwardRequest, *, vocab: int, max_len: int, max_datums: int
) -> ForwardBackwardInput:
    """What a parsed request asks for, once it is known to be trainable.

    Raises:
        TinkerRequestError: unknown or unsupported loss, missing or misshapen inputs, token
            ids outside the vocabulary, non-finite numbers, no datums or too many.
    """
    if msg.loss_fn not in LOSS_INPUTS:
        raise TinkerRequestError(
            f"loss_fn {quoted(msg.loss_fn)} is not supported by plies serve yet; "
            f"supported: {', '.join(SUPPORTED_LOSSES)}"
        )
    if not 1 <= len(msg.data) <= max_datums:
        raise TinkerRequestError(
            f"a forward_backward request takes 1 to {max_datums} datums, got {len(msg.data)}"
        )
    config = {k: v.number for k, v in msg.loss_fn_config_v2.items() if v.HasField("number")}
    for k, v in msg.loss_fn_config.items():
        config.setdefault(k, v)
    texts = [k for k, v in msg.loss_fn_config_v2.items() if v.HasField("text")]
    allowed = _CONFIG_KEYS.get(msg.loss_fn, set())
    unknown = sorted((set(config) | set(texts)) - allowed)
    if unknown:
        raise TinkerRequestError(f"loss_fn_config keys {unknown} are not used by {msg.loss_fn}")
    if not all(np.isfinite(v) for v in config.values()):
        raise TinkerRequestError("loss_fn_config holds a non-finite number")
    if msg.loss_fn == "dro" and "beta" not in config:
        raise TinkerRequestError("dro needs loss_fn_config {'beta': ...} (the penalty's weight)")
    budget = _Budget()
    data = [_datum(d, k, msg.loss_fn, vocab, max_len, budget) for k, d in enumerate(msg.data)]
    return ForwardBackwardInput(
        model_id=msg.model_id,
        seq_id=msg.seq_id,
        loss_fn=msg.loss_fn,
        config=config,
        forward_only=msg.forward_only,
        data=data,
    )


def encode_forward_backward(logprobs: list[np.ndarray], metrics: dict[str, float]) -> bytes:
    """A `ForwardBackwardOutput`: each datum's target logprobs ([T] or [T, K]) and metrics.

    Datums of one trailing shape share an `ArrayRecord`; consecutive runs keep their order.
    """
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in metrics.items():
        out.metrics[key] = value
    runs: list[list[np.ndarray]] = []
    for lp in logprobs:
        if runs and runs[-1][0].shape[1:] == lp.shape[1:]:
            runs[-1].append(lp)
        else:
            runs.append([lp])
    for run in runs:
        record = out.loss_fn_outputs.add()
        record.num_datums = len(run)
        arrays = [np.ascontiguousarray(a, dtype=np.float32) for a in run]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        field_ = record.fields["logprobs"]
        field_.dtype = pb.DTYPE_FLOAT32
        field_.data = b"".join(a.tobytes() for a in arrays)
        field_.offsets = offsets.tobytes()
        field_.trailing_shape.extend(run[0].shape[1:])
    return out.SerializeToString()


@dataclass
class PromptScores:
    """Logprobs of the prompt's own tokens ([n], NaN where not scored: position 0 and any
    before `prompt_logprobs_last_n`) and, if asked, the top-k tokens at each position."""

    logprobs: np.ndarray  # (n,) float32
    topk_ids: np.ndarray | None = None  # (n, k) int32, 0 where not scored
    topk_logprobs: np.ndarray | None = None  # (n, k) float32, MASK_LOGPROB where not scored
    include_logprobs: bool = True


MASK_LOGPROB = -99999.0
"""The SDK's filler for top-k cells that hold no token (`tinker.types.topk_logprobs`)."""


def encode_samples(
    samples: list[tuple[list[int], list[float], bool]], prompt: PromptScores | None = None
) -> bytes:
    """A `SampleResponse`: per sequence its tokens, logprobs and whether it hit a stop, and
    the prompt's scores if they were asked for."""
    out = pb.SampleResponse()
    if prompt is not None:
        if prompt.include_logprobs:
            out.prompt_logprobs = np.asarray(prompt.logprobs, dtype=np.float32).tobytes()
        if prompt.topk_ids is not None and prompt.topk_logprobs is not None:
            n, k = prompt.topk_ids.shape
            out.topk_prompt_logprobs.length, out.topk_prompt_logprobs.k = n, k
            out.topk_prompt_logprobs.token_ids = prompt.topk_ids.astype(np.int32).tobytes()
            out.topk_prompt_logprobs.logprobs = prompt.topk_logprobs.astype(np.float32).tobytes()
    for tokens, logprobs, stopped in samples:
        seq = out.sequences.add()
        seq.stop_reason = pb.STOP_REASON_STOP if stopped else pb.STOP_REASON_LENGTH
        seq.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(logprobs, dtype=np.float32).tobytes()
    return out.SerializeToString()
