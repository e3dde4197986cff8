"""ServeConfig: everything `kvcache serve` needs, from flags or a TOML file, printed at start-up."""
from __future__ import annotations

import dataclasses
import os
import re
import sys
from pathlib import Path
from typing import Any, Sequence

from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.rows import Row
from kvcache.allocator.swa import AttentionPolicy, Full, Window

LOCAL_OFF = "off"  # local_endpoint's value for no local endpoint
_TYPES = {"str": str, "int": int, "float": (int, float), "bool": bool}  # ServeConfig's field types, as accepted
_TYPE_NAMES = {str: "a string", int: "an integer", (int, float): "a number", bool: "true or false"}

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


def runtime_dir() -> Path:
    """Where default ipc:// sockets live: $XDG_RUNTIME_DIR/kvcache, else /tmp/kvcache-$UID (mode 0700)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = Path(base) / "kvcache" if base else Path(f"/tmp/kvcache-{os.getuid()}")
    return path


@dataclasses.dataclass(slots=True)
class ServeConfig:
    """One daemon's configuration; sizes come from ``num_blocks`` or from a model and a memory budget."""

    endpoint: str = ""
    pub_endpoint: str = ""
    replay_endpoint: str = ""
    events_endpoint: str = ""
    events_replay_endpoint: str = ""
    local_endpoint: str = ""
    num_blocks: int = 0
    block_size: int = 64
    rows: str = "full"
    model: str = ""
    gpu_memory: str = "80GiB"
    utilization: float = 0.9
    reserve: str = "0"
    dtype: str = ""
    quant: str = "none"
    scale_layout: str = "default"
    tp: int = 1
    head_wise: bool = False
    max_model_len: int = 0
    max_num_batched_tokens: int = 0
    enable_prefix_caching: bool = True
    hash_algorithm: str = "sha256"
    hash_seed: str = ""
    events: bool = False
    events_format: str = "map"
    events_hashes: str = ""
    events_topic: str = ""
    data_parallel_rank: int = 0
    metrics_port: int = 0
    max_message_bytes: int = 64 * 2**20
    max_tokens: int = 1 << 22
    max_slots: int = 65_536
    max_reply_bytes: int = 64 * 2**20
    replay_buffer: int = 4096
    replay_bytes: int = 256 * 2**20
    dedupe_window: int = 1024
    dedupe_bytes: int = 64 * 2**20
    pub_bytes: int = 64 * 2**20
    io_threads: int = 1
    heartbeat_ms: int = 100
    journal: str = ""
    lease_timeout: float = 0.0
    curve_server_cert: str = ""
    curve_clients_dir: str = ""
    snapshot_bytes: int = 256 * 2**20
    role: str = "both"
    transfer_timeout: float = 30.0
    host_memory: str = "0"
    host_block_budget: int = 0
    tier_timeout: float = 30.0

    def resolved(self) -> ServeConfig:
        """A copy with default endpoints filled in next to ``endpoint``."""
        cfg = dataclasses.replace(self)
        if not cfg.endpoint:
            cfg.endpoint = f"ipc://{runtime_dir()}/kvcache.sock"
        derived = derive_endpoints(cfg.endpoint)
        for name, value in derived.items():
            if not getattr(cfg, name):
                setattr(cfg, name, value)
        return cfg

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # a TOML file can give any type: name the field, not a traceback later
            value, kind = getattr(self, f.name), _TYPES[str(f.type)]
            if isinstance(value, bool) is not (kind is bool) or not isinstance(value, kind):
                raise KVCacheError(f"{f.name}: must be {_TYPE_NAMES[kind]}, got {value!r}")
        if self.events_format not in ("array", "map"):
            raise KVCacheError(f"events_format: {self.events_format!r} is neither 'array' nor 'map'")
        if self.events_hashes not in ("", "int", "bytes"):
            raise KVCacheError(f"events_hashes: {self.events_hashes!r} is none of int, bytes (empty = the format's own)")
        if not 0 <= self.data_parallel_rank < 2**31:
            raise KVCacheError(f"data_parallel_rank: must be an integer in [0, 2**31), got {self.data_parallel_rank}")
        if self.role not in ("both", "prefill", "decode"):
            raise KVCacheError(f"role: {self.role!r} is not one of both, prefill, decode")
        if isinstance(self.io_threads, bool) or not isinstance(self.io_threads, int) or not 1 <= self.io_threads <= 64:
            raise KVCacheError(f"io_threads: must be an integer in [1, 64], got {self.io_threads!r}")
        for name in ("max_message_bytes", "max_reply_bytes", "max_tokens", "max_slots", "replay_buffer", "replay_bytes",
                     "dedupe_bytes", "pub_bytes", "snapshot_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise KVCacheError(f"{name}: must be a positive integer, got {value!r}")
        if isinstance(self.dedupe_window, bool) or not isinstance(self.dedupe_window, int) or self.dedupe_window < 1:
            raise KVCacheError(f"dedupe_window: must be a positive integer (retries and the local endpoint's resend "
                               f"are answered from kept replies), got {self.dedupe_window!r}")
        for name in ("max_model_len", "max_num_batched_tokens"):
            if getattr(self, name) < 0:
                raise KVCacheError(f"{name}: must be an integer >= 0 (0 = unset), got {getattr(self, name)}")
        for name in ("transfer_timeout", "tier_timeout"):
            if not getattr(self, name) > 0:
                raise KVCacheError(f"{name}: must be positive seconds, got {getattr(self, name)!r}")
        if self.host_block_budget < 0:
            raise KVCacheError(f"host_block_budget: must be an integer >= 0 (0 = from --host-memory), got "
                               f"{self.host_block_budget}")

    def describe(self) -> str:
        """One line per field, for the start-up log."""
        return "\n".join(f"  {f.name} = {getattr(self, f.name)!r}" for f in dataclasses.fields(self))


def derive_endpoints(endpoint: str) -> dict[str, str]:
    """Default PUB/replay/event endpoints next to the scheduler endpoint (ipc: sibling files; tcp: next ports).

    The local endpoint (a Unix datagram socket's path) sits beside an ipc:// endpoint; a tcp:// daemon has none.
    """
    names = ("pub_endpoint", "replay_endpoint", "events_endpoint", "events_replay_endpoint")
    if endpoint.startswith("ipc://"):
        base = endpoint[len("ipc://"):]
        stem = base[:-5] if base.endswith(".sock") else base
        suffixes = ("-pub.sock", "-replay.sock", "-events.sock", "-events-replay.sock")
        return {**{n: f"ipc://{stem}{s}" for n, s in zip(names, suffixes)}, "local_endpoint": f"{stem}-local.sock"}
    match = re.fullmatch(r"tcp://(.+):(\d+)", endpoint)
    if match:  # a tcp daemon may serve other hosts: no local endpoint unless asked for
        host, port = match.group(1), int(match.group(2))
        return {**{n: f"tcp://{host}:{port + i + 1}" for i, n in enumerate(names)}, "local_endpoint": LOCAL_OFF}
    raise KVCacheError(f"endpoint: {endpoint!r} is neither ipc://PATH nor tcp://HOST:PORT")


def load_toml(path: str | Path) -> dict[str, Any]:
    """Fields from a TOML file (top level or a [serve] table), checked against ServeConfig's names."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise KVCacheError(f"--config: cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise KVCacheError(f"--config: {path} is not valid TOML: {exc}") from None
    data = data.get("serve", data)
    known = {f.name: f for f in dataclasses.fields(ServeConfig)}
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in known:
            raise KVCacheError(f"--config: unknown setting {key!r}")
        out[name] = value
    return out


def parse_rows(spec: str, num_rows: int | None = None) -> list[AttentionPolicy]:
    """Row policies from ``full``, ``window:W[:S]`` items, each optionally ``*N``, comma-separated.

    ``"window:4096:64*6,full*2"`` is six sliding-window heads and two full ones.
    A single item with ``num_rows`` given is repeated to that many rows.
    """
    rows: list[AttentionPolicy] = []
    for item in (s.strip() for s in spec.split(",")):
        body, _, count = item.partition("*")
        times = 1
        if count:
            if not count.isdigit() or int(count) < 1:
                raise KVCacheError(f"rows: bad repeat count in {item!r}")
            times = int(count)
        parts = body.split(":")
        if parts == ["full"]:
            policy: AttentionPolicy = Full()
        elif parts[0] == "window" and len(parts) in (2, 3) and all(p.isdigit() for p in parts[1:]):
            policy = Window(int(parts[1]), int(parts[2]) if len(parts) == 3 else 0)
        else:
            raise KVCacheError(f"rows: cannot read {item!r}; write full or window:W[:S], optionally *N")
        rows.extend([policy] * times)
    if num_rows is not None and len(rows) != num_rows:
        if len(rows) == 1:
            return rows * num_rows
        raise KVCacheError(f"rows: {len(rows)} policies given, the model has {num_rows} kv heads")
    return rows


def describe_rows(rows: Sequence[AttentionPolicy], row_blocks: Sequence[int],
                  layout: Sequence[Row] | None = None) -> list[dict[str, Any]]:
    """The rows as plain maps for the info reply: each one's policy and pool size (``num_blocks``), and with a
    ``layout`` its cells (``layers``, ``kv_heads``)."""
    if layout is not None:
        return [{**row.describe(), "num_blocks": n} for row, n in zip(layout, row_blocks)]
    return [({"kind": "full"} if isinstance(p, Full) else
             {"kind": "window", "window": p.window_tokens, "sink": p.sink_tokens}) | {"num_blocks": n}
            for p, n in zip(rows, row_blocks)]