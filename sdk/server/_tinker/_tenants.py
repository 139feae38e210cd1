"""Tenants: one per `create_model`, each with its own trainable weights and optimizer state.

A tenant with a `lora_config` trains a LoRA adapter (peft) over its own copy of the base
weights: attention, MLP and unembedding projections as the config's flags say, rank `rank`,
alpha `LORA_ALPHA`, initialised from `seed`. Without one it trains every weight of its copy.
Tenants never share a tensor, so one tenant's steps cannot change another's numbers.

Sampler snapshots are the merged weights (base + adapter), published as immutable versions
of the tenant's own `PolicyStore` under `STATE_DIR/tinker/<model>/`, which the engine loads
like any published policy. Methods are blocking: the work queue runs them in a thread, one
at a time per tenant.
"""

from __future__ import annotations

import copy
import logging
import math
from pathlib import Path
from typing import Any

import torch

from .._adam import StepRefused, adam_step
from .._config import TrainerConfig
from .._losses import tinker_loss
from .._policies import PolicyStore
from ._checkpoints import SavedState
from ._errors import TinkerRequestError
from ._oplog import OpLog
from ._proto import ForwardBackwardInput, encode_forward_backward
from ._schemas import AdamParams, LoraConfig

__all__ = ["LORA_ALPHA", "Tenant"]

log = logging.getLogger("plies.server.tinker")

LORA_ALPHA = 32
"""LoRA scaling numerator (the update is `alpha / rank * B @ A`), as Tinker documents it."""

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def _lora_targets(model: torch.nn.Module, lora: LoraConfig) -> list[str]:
    """Names of the linear layers the flags select, as found in this model."""
    wanted = (_ATTN if lora.train_attn else ()) + (_MLP if lora.train_mlp else ())
    found = sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in wanted
        }
    )
    if lora.train_unembed:
        if getattr(model.config, "tie_word_embeddings", False):
            raise TinkerRequestError(
                "train_unembed=True on a model with tied embeddings is not supported yet; "
                "pass train_unembed=False"
            )
        found.append("lm_head")
    if not found:
        raise TinkerRequestError("lora_config selects no layer of this model to train")
    return found


class Tenant:
    """One training run: `model_id`, weights (or adapter), optimizer and sampler snapshots."""

    def __init__(
        self,
        model_id: str,
        session_id: str,
        lora: LoraConfig | None,
        root: Path,
        trainer: TrainerConfig,
    ):
        self.model_id = model_id
        self.session_id = session_id
        self.lora = lora
        self.trainer = trainer
        root.mkdir(parents=True, exist_ok=True)
        (root / "policies").mkdir(exist_ok=True)
        self.store = PolicyStore(root)
        self.oplog = OpLog(root)
        self.model: Any = None
        self.optimizer: torch.optim.AdamW | None = None
        self.bad_loss = False  # a backward since the last step had a non-finite loss

    def build(self, base_dir: Path, device: torch.device) -> dict[str, Any]:
        """Load the tenant's copy of the base weights (and its adapter); the create result."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        model = model.to(device).eval()  # no dropout: the sampler's distribution
        if self.lora is not None:
            from peft import LoraConfig as PeftLoraConfig
            from peft import get_peft_model

            config = PeftLoraConfig(
                r=self.lora.rank,
                lora_alpha=LORA_ALPHA,
                lora_dropout=0.0,
                target_modules=_lora_targets(model, self.lora),
            )
            with torch.random.fork_rng(devices=[]):
                if self.lora.seed is not None:
                    torch.manual_seed(self.lora.seed)
                model = get_peft_model(model, config)
        self.model = model
        return {"model_id": self.model_id}

    @property
    def network(self) -> torch.nn.Module:
        """The causal LM the loss runs on (peft injects its layers into it in place)."""
        return self.model.base_model.model if self.lora is not None else self.model

    def forward_backward(self, req: ForwardBackwardInput) -> bytes:
        """Add the gradients of `req` (none when forward-only); the encoded output."""
        result = tinker_loss(
            self.network,
            req.data,
            req.loss_fn,
            req.config,
            backward=not req.forward_only,
            max_head_rows=self.trainer.max_head_rows,
            max_micro_tokens=self.trainer.max_micro_tokens,
        )
        if not math.isfinite(result.loss):
            if req.forward_only:
                raise TinkerRequestError(f"the {req.loss_fn} loss is not finite ({result.loss})")
            self.model.zero_grad(set_to_none=True)
            self.bad_loss = True
            raise TinkerRequestError(
                f"the {req.loss_fn} loss is not finite ({result.loss}); the accumulated "
                "gradients were discarded, and the next optim_step is refused"
            )
        return encode_forward_backward(result.logprobs, {"loss:sum": result.loss})

    def _params(self) -> list[torch.nn.Parameter]:
        return [q for q in self.model.parameters() if q.requires_grad]

    def _new_optimizer(self) -> torch.optim.AdamW:
        return torch.optim.AdamW(self._params())  # optim_step sets the hyperparameters

    def optim_step(self, p: AdamParams) -> dict[str, Any]:
        """One AdamW step on the accumulated gradients, which are then cleared.

        A step on a non-finite gradient norm, or after a backward whose loss was not finite,
        would write NaN into the weights or the Adam moments for good; it is refused instead,
        with the weights and optimizer state as they were and the gradients discarded. So is
        a step that leaves any weight or moment not finite: it is undone. The step is the
        native trainer's too (`_adam.adam_step`); only the wording of a refusal is Tinker's.
        """
        params = self._params()
        if self.bad_loss:
            self.bad_loss = False
            raise TinkerRequestError(
                "optim_step refused: a forward_backward since the last step had a non-finite "
                "loss; the weights are unchanged and the gradients were discarded"
            )
        try:
            self.optimizer, norm = adam_step(self.optimizer, params, p.settings)
        except StepRefused as exc:
            if math.isfinite(exc.norm):
                detail = (
                    f"{exc.reason} (learning_rate {p.learning_rate:g}, eps {p.eps:g}, "
                    f"weight_decay {p.weight_decay:g}, gradient norm {exc.norm:g}); it was undone"
                )
            else:
                detail = exc.reason
            raise TinkerRequestError(
                f"optim_step refused: {detail}; the weights and optimizer state are as they "
                "were and the gradients were discarded"
            ) from None
        finally:
            self.model.zero_grad(set_to_none=True)
        return {"metrics": {"grad_norm:mean": norm, "learning_rate:mean": p.learning_rate}}

    def saved_state(self, meta: dict[str, Any], *, optimizer: bool = True) -> SavedState:
        """The trainable tensors and AdamW state, as a checkpoint holds them (not copies:
        write them out before the next op runs)."""
        trainable = {
            name: q.detach().cpu() for name, q in self.model.named_parameters() if q.requires_grad
        }
        opt = self.optimizer.state_dict() if optimizer and self.optimizer is not None else None
        return SavedState(meta, trainable, opt)

    def restore(self, state: SavedState) -> None:
        """Set the trainable tensors (and AdamW state, if saved) from a checkpoint.

        Raises:
            TinkerRequestError: the checkpoint's tensors are not this tenant's (400).
        """
        params = dict(self.model.named_parameters())
        mine = {name for name, q in params.items() if q.requires_grad}
        if set(state.trainable) != mine or any(
            params[n].shape != t.shape for n, t in state.trainable.items()
        ):
            raise TinkerRequestError(
                "the checkpoint's trainable weights do not match this model's (another "
                "LoRA rank, other target layers, or a full fine-tune)"
            )
        with torch.no_grad():
            for name, tensor in state.trainable.items():
                params[name].copy_(tensor)
        self.model.zero_grad(set_to_none=True)
        self.bad_loss = False
        self.optimizer = None
        if state.optimizer is not None:
            self.optimizer = self._new_optimizer()
            self.optimizer.load_state_dict(state.optimizer)

    def snapshot(self, tokenizer: Any) -> Path:
        """Publish the merged weights as the tenant's next immutable version; its directory."""
        if self.lora is not None:
            merged = copy.deepcopy(self.model).merge_and_unload()
        else:
            merged = self.model
        ref = self.store.publish(merged, tokenizer)
        log.info("%s: sampler snapshot %s", self.model_id, ref.uri)
        return self.store.path(ref.version)

    def close(self) -> None:
        """Free the weights and optimizer state (published snapshots stay on disk)."""
        self.model = None
        self.optimizer = None
