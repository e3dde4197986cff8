"""ServeConfig: everything `kvcache serve` needs, from flags or a TOML file, printed at start-up."""
from __future__ import annotations

import dataclasses
import os
import re
import sys
from pathlib import Path
from typing import Any, Sequence

from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.layout import MAX_BOUNDS, QuantType, ScaleLayout, normalize_dtype
from kvcache.allocator.prefix import ALGORITHMS
from kvcache.allocator.rows import Row, describe_policy
from kvcache.allocator.swa import AttentionPolicy, Chunked, Full, Window
from kvcache.journal import MAX_WAL_BYTES
from kvcache.units import parse_size

# A --rows item: full or window:W[:S], then *N (numbers of at most 18 digits: int() refuses too long ones)
_ROW_ITEM = re.compile(r"(?:full|window:(?P<window>[0-9]{1,18})(?::(?P<sink>[0-9]{1,18}))?|chunk:(?P<chunk>[0-9]{1,18}))"
                       r"(?:\*(?P<count>[0-9]{1,18}))?")
LOCAL_OFF = "off"  # local_endpoint's value for no local endpoint
_ENDPOINTS = ("endpoint", "pub_endpoint", "replay_endpoint", "events_endpoint", "events_replay_endpoint")
UNIX_PATH_MAX = 107  # bytes of a Unix socket's path (sockaddr_un.sun_path, less its NUL)
_TYPES = {"str": str, "int": int, "float": (int, float), "bool": bool}  # ServeConfig's field types, as accepted
_TYPE_NAMES = {str: "a string", int: "an integer", (int, float): "a number", bool: "true or false"}
INT32_MAX = 2**31 - 1
MAX_BLOCKS = 2**28  # (row pool, block) pairs of a manager, and blocks of a host tier: ~20 bytes each up front
MAX_ROWS = 4096  # row policies --rows may give
MAX_BYTES = 2**40  # byte budgets and limits (1 TiB)
MAX_MEMORY = 2**50  # memory sizes: gpu_memory, reserve, host_memory (1 PiB)
MAX_SECONDS = 7 * 86_400  # timeouts: a week
# Every integer setting's range, and what its ends mean where that needs saying; __post_init__ checks them all.
_INT_RANGES: dict[str, tuple[int, int, str]] = {
    "num_blocks": (0, MAX_BLOCKS, " (0 = size from --model and --gpu-memory)"),
    "block_size": (1, MAX_BOUNDS["block_size"], " tokens"),
    "tp": (1, MAX_BOUNDS["tp_size"], " ranks"),
    "max_model_len": (0, INT32_MAX, " tokens (0 = unset)"),
    "max_num_batched_tokens": (0, INT32_MAX, " tokens (0 = unset)"),
    "data_parallel_rank": (0, INT32_MAX, ""),
    "metrics_port": (0, 65_535, " (0 = off)"),
    "max_message_bytes": (1, MAX_WAL_BYTES // 4, " (each is a record of the journal's log)"),
    "max_tokens": (1, INT32_MAX, ""),
    "max_slots": (1, INT32_MAX, ""),
    "max_reply_bytes": (1, MAX_BYTES, ""),
    "replay_buffer": (1, INT32_MAX, " deltas"),
    "replay_bytes": (1, MAX_BYTES, ""),
    "dedupe_window": (1, INT32_MAX, " replies per client"),
    "dedupe_bytes": (1, MAX_BYTES, ""),
    "pub_bytes": (1, MAX_BYTES, ""),
    "io_threads": (1, 64, ""),
    "heartbeat_ms": (10, 60_000, " (a shorter heartbeat keeps an idle daemon busy)"),
    "snapshot_bytes": (1, MAX_WAL_BYTES // 2, " (a restart reads at most 16 GiB of log)"),
    "host_block_budget": (0, MAX_BLOCKS, " (0 = from --host-memory)"),
}
# Every number setting's range in seconds (or a fraction): (least, most, least allowed, note).
_FLOAT_RANGES: dict[str, tuple[float, float, bool, str]] = {
    "utilization": (0.0, 1.0, False, " (a fraction of --gpu-memory)"),
    "lease_timeout": (0.0, MAX_SECONDS, True, " seconds (0 = never)"),
    "transfer_timeout": (0.0, MAX_SECONDS, False, " seconds"),
    "tier_timeout": (0.0, MAX_SECONDS, False, " seconds"),
}
_CHOICES: dict[str, tuple[str, ...]] = {
    "quant": tuple(q.value for q in QuantType),
    "scale_layout": tuple(s.value for s in ScaleLayout),
    "hash_algorithm": ALGORITHMS,
    "events_format": ("array", "map"),
    "events_hashes": ("", "int", "bytes"),
    "events_groups": ("vllm", "policy"),
    "role": ("both", "prefill", "decode"),
}

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
    per_request_chunks: bool = False
    enable_prefix_caching: bool = True
    hash_algorithm: str = "sha256"
    hash_seed: str = ""
    events: bool = False
    events_format: str = "map"
    events_hashes: str = ""
    events_groups: str = "vllm"
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
                port = re.fullmatch(r"tcp://.+:(\d+)", value)
                if port and int(port.group(1)) > 65_535:
                    raise KVCacheError(f"{name}: its default, a port after {cfg.endpoint}'s, is past 65535; give "
                                       f"--{name.replace('_', '-')}")
                setattr(cfg, name, value)
        paths = {n: getattr(cfg, n)[len("ipc://"):] for n in _ENDPOINTS if getattr(cfg, n).startswith("ipc://")}
        if cfg.local_endpoint != LOCAL_OFF:
            paths["local_endpoint"] = cfg.local_endpoint
        for name, path in paths.items():
            if len(path.encode()) > UNIX_PATH_MAX:
                raise KVCacheError(f"{name}: {path!r} is {len(path.encode())} bytes, longer than the {UNIX_PATH_MAX} "
                                   f"a Unix socket's path takes")
        return cfg

    def __post_init__(self) -> None:
        """Check every field's type and range, naming the first bad one: flags and a TOML file alike end here."""
        for f in dataclasses.fields(self):  # a TOML file can give any type: name the field, not a traceback later
            value, kind = getattr(self, f.name), _TYPES[str(f.type)]
            if isinstance(value, bool) is not (kind is bool) or not isinstance(value, kind):
                raise KVCacheError(f"{f.name}: must be {_TYPE_NAMES[kind]}, got {value!r}")
        if self.dedupe_window < 1:
            raise KVCacheError(f"dedupe_window: must be a positive integer (retries and the local endpoint's resend "
                               f"are answered from kept replies), got {self.dedupe_window}")
        for name, (least, most, note) in _INT_RANGES.items():
            value = getattr(self, name)
            if not least <= value <= most:
                raise KVCacheError(f"{name}: must be an integer in [{least}, {most}]{note}, got {value}")
        for name, (low, high, low_ok, note) in _FLOAT_RANGES.items():
            value = getattr(self, name)
            if not (low <= value if low_ok else low < value) or not value <= high:  # NaN fails both
                interval = f"{'[' if low_ok else '('}{low:g}, {high:g}]"
                raise KVCacheError(f"{name}: must be a number in {interval}{note}, got {value!r}")
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                shown = ", ".join(repr(c) for c in choices)
                raise KVCacheError(f"{name}: {getattr(self, name)!r} is not one of {shown}")
        if self.dtype:
            normalize_dtype(self.dtype)
        for name in ("gpu_memory", "reserve", "host_memory"):
            if parse_size(getattr(self, name), name) > MAX_MEMORY:
                raise KVCacheError(f"{name}: {getattr(self, name)!r} is over the limit of 1 PiB ({MAX_MEMORY} bytes)")
        parse_rows(self.rows)
        if self.endpoint:
            derive_endpoints(self.endpoint)

    def describe(self) -> str:
        """One line per field, for the start-up log; a hash seed shows only whether one is set (it is a secret)."""
        shown = {"hash_seed": "'(set)'" if self.hash_seed else "''"}
        return "\n".join(f"  {f.name} = {shown.get(f.name, repr(getattr(self, f.name)))}"
                         for f in dataclasses.fields(self))


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
    match = re.fullmatch(r"tcp://(.+):([0-9]{1,5})", endpoint)
    if match:  # a tcp daemon may serve other hosts: no local endpoint unless asked for
        host, port = match.group(1), int(match.group(2))
        if port > 65_535:
            raise KVCacheError(f"endpoint: port {port} of {endpoint!r} is past 65535")
        return {**{n: f"tcp://{host}:{port + i + 1}" for i, n in enumerate(names)}, "local_endpoint": LOCAL_OFF}
    raise KVCacheError(f"endpoint: {endpoint!r} is neither ipc://PATH nor tcp://HOST:PORT")


def load_toml(path: str | Path) -> dict[str, Any]:
    """Fields from a TOML file (top level or a [serve] table), checked against ServeConfig's names."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise KVCacheError(f"--config: cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise KVCacheError(f"--config: {path} is not UTF-8 text (byte {exc.start}); TOML files are UTF-8") from None
    except (tomllib.TOMLDecodeError, ValueError) as exc:  # ValueError: an integer of over 4300 digits
        raise KVCacheError(f"--config: {path} is not valid TOML: {exc}") from None
    data = data.get("serve", data)
    if not isinstance(data, dict):
        raise KVCacheError(f"--config: serve must be a table of settings, got {data!r}")
    known = {f.name: f for f in dataclasses.fields(ServeConfig)}
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in known:
            raise KVCacheError(f"--config: unknown setting {key!r}")
        out[name] = value
    return out


def parse_rows(spec: str, num_rows: int | None = None) -> list[AttentionPolicy]:
    """Row policies from ``full``, ``window:W[:S]`` and ``chunk:C`` items, each optionally ``*N``, comma-separated.

    ``"window:4096:64*6,full*2"`` is six sliding-window heads and two full ones; ``"chunk:8192,full"`` is a
    chunked-local-attention row (Llama 4) and a full one.
    A single item with ``num_rows`` given is repeated to that many rows. At most ``MAX_ROWS`` rows, counted before
    any is built; window and sink tokens at most 2**31 - 1.
    """
    rows: list[AttentionPolicy] = []
    for item in (s.strip() for s in spec.split(",")):
        match = _ROW_ITEM.fullmatch(item)
        if match is None:
            raise KVCacheError(f"rows: cannot read {item!r}; write full, window:W[:S] or chunk:C, optionally *N")
        window, sink, chunk, count = (None if g is None else int(g)
                                      for g in match.group("window", "sink", "chunk", "count"))
        times = 1 if count is None else count
        if times < 1:
            raise KVCacheError(f"rows: bad repeat count in {item!r}")
        if len(rows) + times > MAX_ROWS:
            raise KVCacheError(f"rows: {spec[:80]!r} gives more than {MAX_ROWS} rows")
        if chunk is not None:
            if not 1 <= chunk <= INT32_MAX:
                raise KVCacheError(f"rows: a chunk needs 1 to {INT32_MAX} tokens, got {item!r}")
            policy: AttentionPolicy = Chunked(chunk)
        elif window is None:
            policy = Full()
        elif not 1 <= window <= INT32_MAX or (sink or 0) > INT32_MAX:
            raise KVCacheError(f"rows: a window needs 1 to {INT32_MAX} tokens and a sink at most {INT32_MAX}, got "
                               f"{item!r}")
        else:
            policy = Window(window, sink or 0)
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
    return [describe_policy(p) | {"num_blocks": n} for p, n in zip(rows, row_blocks)]