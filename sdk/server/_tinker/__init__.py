"""The Tinker API on `plies serve`: the unmodified `tinker` SDK trains and samples here.

Layout: `_routes.py` (the `/api/v1/` routes), `_service.py` (sessions, tenants, sampling
sessions, and their recovery at a restart), `_futures.py` (futures and the per-model `seq_id`
queue), `_tenants.py` (weights, LoRA adapter and optimizer per `create_model`), `_proto.py`
(the SDK's protobuf messages), `_samplers.py` (sampling on the shared engine),
`_checkpoints.py` (runs and `save_weights` checkpoints on disk), `_training_runs.py` (their
REST views), `_oplog.py` (each tenant's op journal and state, for exactly-once),
`_schemas.py` (JSON bodies), `_errors.py` (Tinker's error shape). The losses, the AdamW
step and the ledger's parts are the native trainer's (`.._losses.tinker_loss`,
`.._adam.adam_step`, `.._journal`). See docs/tinker.md.

It needs the `tinker` package (`pip install 'plies[tinker]'`) for the SDK's generated
protobuf module; without it the server runs with the native routes only.
"""

from ._routes import tinker_router as tinker_router
from ._service import TinkerService as TinkerService

__all__ = ["TinkerService", "tinker_router"]
