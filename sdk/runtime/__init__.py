"""The runtime: resources and leases, quarantine, the rollout driver, signals and sinks.

- `RolloutResources` holds the policy client and the pools episodes borrow from, and writes
  the quarantine report when it closes.
- `Pool` (`EnvPool`, `HarnessPool`) lends `Lease`s on resources it creates and tears down;
  `lease.operation(name)` marks remote work that cancellation waits for (a `SettleWatch`
  lets a loop's blocks share one watcher). A resource that `HoldsRemote` names its remote
  state as `RemoteRef`s, which a quarantine report lists.
- `RolloutDriver` runs episodes of admitted groups and hands back complete groups;
  `ShardedDriver` (the `plies[ray]` extra) does the same over rollout shards on Ray actors.
- `run` wraps a script's main with three-step Ctrl-C handling; `JsonlSink` and `read_jsonl`
  write and read records a crash cannot corrupt, `write_atomic` and `fsync_dir` replace and
  flush the files beside them; `reap_report` (`plies reap`) tears down what a quarantine
  report lists.
"""

import inspect

from .._durable import fsync_dir as fsync_dir
from .._durable import write_atomic as write_atomic
from ._admission import DriverState as DriverState
from ._admission import DriverStatistics as DriverStatistics
from ._driver import RolloutDriver as RolloutDriver
from ._episode import EpisodeContext as EpisodeContext
from ._episode import GroupSpec as GroupSpec
from ._lease import Lease as Lease
from ._lease import LeaseState as LeaseState
from ._pool import EnvPool as EnvPool
from ._pool import HarnessPool as HarnessPool
from ._pool import Pool as Pool
from ._pool import PoolStatistics as PoolStatistics
from ._progress import LiveProgress as LiveProgress
from ._reap import Reaper as Reaper
from ._reap import ReapOutcome as ReapOutcome
from ._reap import ReapResult as ReapResult
from ._reap import builtin_reapers as builtin_reapers
from ._reap import process_remote_id as process_remote_id
from ._reap import reap_process as reap_process
from ._reap import reap_report as reap_report
from ._remote import HoldsRemote as HoldsRemote
from ._remote import RemoteRef as RemoteRef
from ._report import QuarantineRecord as QuarantineRecord
from ._report import QuarantineReport as QuarantineReport
from ._report import read_report as read_report
from ._resources import ResourcesStatistics as ResourcesStatistics
from ._resources import RolloutResources as RolloutResources
from ._settle import SettleWatch as SettleWatch
from ._settle import SettlingState as SettlingState
from ._shard import ShardSetup as ShardSetup
from ._sharded import ShardedDriver as ShardedDriver
from ._sharded import ShardLost as ShardLost
from ._sharded import ShardStatistics as ShardStatistics
from ._signals import Interrupts as Interrupts
from ._signals import run as run
from ._sink import JsonlRead as JsonlRead
from ._sink import JsonlSink as JsonlSink
from ._sink import MalformedLine as MalformedLine
from ._sink import read_groups as read_groups
from ._sink import read_jsonl as read_jsonl

__all__ = [
    "DriverState",
    "DriverStatistics",
    "EnvPool",
    "EpisodeContext",
    "GroupSpec",
    "HarnessPool",
    "HoldsRemote",
    "Interrupts",
    "JsonlRead",
    "JsonlSink",
    "Lease",
    "LeaseState",
    "LiveProgress",
    "MalformedLine",
    "Pool",
    "PoolStatistics",
    "QuarantineRecord",
    "QuarantineReport",
    "ReapOutcome",
    "ReapResult",
    "Reaper",
    "RemoteRef",
    "ResourcesStatistics",
    "RolloutDriver",
    "RolloutResources",
    "SettleWatch",
    "SettlingState",
    "ShardLost",
    "ShardSetup",
    "ShardStatistics",
    "ShardedDriver",
    "builtin_reapers",
    "fsync_dir",
    "process_remote_id",
    "read_groups",
    "read_jsonl",
    "read_report",
    "reap_process",
    "reap_report",
    "run",
    "write_atomic",
]

for _name in __all__:
    _obj = globals()[_name]
    if isinstance(_obj, type) or inspect.isfunction(_obj):
        _obj.__module__ = "plies.runtime"
del _name, _obj
