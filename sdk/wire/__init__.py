"""Wire schemas shared by plies' clients and its reference server.

- `plies.wire.training`: what `TrainingClient` sends and a trainer answers (`Datum`,
  `TrainingBatch`, `AdamParams`, the requests, results, `OpRecord`, `ErrorCode`).
- `plies.wire.sampling`: the vLLM-shaped (and SGLang-shaped) sampling subset the reference
  server speaks, and `served_name`, the rule that names a served policy.

The package itself exports nothing: each schema is imported from the module that defines it,
so every name has one place. Both sides import these modules and neither imports the other:
the server is a separate process, and the clients must also work against servers that are not
plies. This package depends only on `plies.trajectory`, the error tree and pydantic.
"""

__all__ = []
