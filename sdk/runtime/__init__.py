"""The runtime: resources and leases, quarantine, the rollout driver, signals and sinks.

- `RolloutResources` holds the policy client and the pools episodes borrow from, and writes
  the quarantine report when it closes.
- `Pool` (`EnvPool`, `HarnessPool`) lends `Lease`s on resources it creates and tears down;
  `lease.operation(name)` marks remote work that cancellation waits for (a `SettleWatch`
  lets a loop's blocks share one watcher). A resource that `HoldsRemote` names its remote
  state as `RemoteRef`s, which a quarantine report lists.
- `RolloutDriver` runs episodes of admitted groups and hands back complete groups;
  `ShardedDriver` (the `plies[ray]` extra) does the same over rollout shards on Ray actors.
- `run` wraps a script's main with three-step Ctrl-C handling (and `long_run_collector`, which
  keeps the cyclic collector's full scans off what was loaded); `JsonlSink` and `read_jsonl`
  write and read records a crash cannot corrupt; `reap_report` (`plies reap`) tears down what
  a quarantine report lists, with `builtin_reapers()` and your own `Reaper`s.
"""

from .._exports import name_after as _name_after
from ._collector import long_run_collector as long_run_collector
from ._driver import RolloutDriver as RolloutDriver
from ._episode import EpisodeContext as EpisodeContext
from ._episode import GroupSpec as GroupSpec
from ._lease import Lease as Lease
from ._pool import EnvPool as EnvPool
from ._pool import HarnessPool as HarnessPool
from ._pool import Pool as Pool
from ._reap import Reaper as Reaper
from ._reap import builtin_reapers as builtin_reapers
from ._reap import process_remote_id as process_remote_id
from ._reap import reap_report as reap_report
from ._remote import HoldsRemote as HoldsRemote
from ._remote import RemoteRef as RemoteRef
from ._report import QuarantineReport as QuarantineReport
from ._resources import RolloutResources as RolloutResources
from ._settle import SettleWatch as SettleWatch
from ._shard import ShardSetup as ShardSetup
from ._sharded import ShardedDriver as ShardedDriver
from ._sharded import ShardLost as ShardLost
from ._signals import Interrupts as Interrupts
from ._signals import run as run
from ._sink import JsonlRead as JsonlRead
from ._sink import JsonlSink as JsonlSink
from ._sink import MalformedLine as MalformedLine
from ._sink import read_jsonl as read_jsonl

__all__ = [
    "EnvPool",
    "EpisodeContext",
    "GroupSpec",
    "HarnessPool",
    "HoldsRemote",
    "Interrupts",
    "JsonlRead",
    "JsonlSink",
    "Lease",
    "MalformedLine",
    "Pool",
    "QuarantineReport",
    "Reaper",
    "RemoteRef",
    "RolloutDriver",
    "RolloutResources",
    "SettleWatch",
    "ShardLost",
    "ShardSetup",
    "ShardedDriver",
    "builtin_reapers",
    "long_run_collector",
    "process_remote_id",
    "read_jsonl",
    "reap_report",
    "run",
]

_name_after(__name__, globals())
