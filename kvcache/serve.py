"""`kvcache serve`: build the manager a ServeConfig describes and run the daemon until SIGTERM or SIGINT.

SIGHUP reads the allowed clients' keys (``--curve-clients-dir``) again: a
revoked client's open connections get nothing more (``kvcache keys revoke``).
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
from typing import Any

from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.groups import vllm_group_numbers
from kvcache.allocator.layout import CacheSpec
from kvcache.allocator.manager import KVCacheManager
from kvcache.allocator.rows import Row, rows_of_rank
from kvcache.config import MAX_BLOCKS, ServeConfig, load_toml, parse_rows
from kvcache.plan import Load, Plan, make_plan
from kvcache.units import parse_size

HELP = {
    "endpoint": "scheduler socket, ipc://PATH or tcp://HOST:PORT (default ipc://$XDG_RUNTIME_DIR/kvcache/kvcache.sock, "
                "else /tmp/kvcache-$UID/kvcache.sock)",
    "pub_endpoint": "PUB socket for table deltas (default: next to --endpoint: PATH-pub.sock, or port+1)",
    "replay_endpoint": "ROUTER socket for missed deltas and snapshots (default: PATH-replay.sock, or port+2)",
    "events_endpoint": "PUB socket for KV events in vLLM's format (default: PATH-events.sock, or port+3)",
    "events_replay_endpoint": "ROUTER socket replaying KV events (default: PATH-events-replay.sock, or port+4)",
    "local_endpoint": "Unix datagram socket (a path) for same-host clients: a round trip skips ZMQ's I/O threads, "
                      "about 10x faster (default: PATH-local.sock next to an ipc:// --endpoint; none for tcp://; "
                      "'off' disables)",
    "num_blocks": "blocks of every row's pool; 0 = size from --model and --gpu-memory (the row pools' blocks "
                  "together at most 2**28)",
    "block_size": "tokens per block (default 64, at most 2**20)",
    "rows": "row policies: full (uniform), or comma-separated full / window:W[:S] / chunk:C (chunked local "
            "attention, C a multiple of --block-size) items with *N repeats (at most 4096 rows), e.g. "
            "'window:4096:64*6,full*2' or 'chunk:8192,full'; with --head-wise a single item applies to every kv head "
            "(default: the --model config's sliding windows, one row per layer group, else one full row)",
    "model": "HF config.json (or its folder, or a built-in example name) to size the cache from",
    "gpu_memory": "GPU memory per rank for sizing with --model (default 80GiB)",
    "utilization": "fraction of --gpu-memory for the cache (default 0.9)",
    "reserve": "memory per GPU for weights and activations, subtracted before sizing (default 0)",
    "dtype": "model dtype for sizing (default: the config's)",
    "quant": "KV quant type for sizing (none, int8, fp8, int8_zp, int4_zp, block_wise_fp8, mla, mla_fp8)",
    "scale_layout": "block_wise_fp8 scale layout for sizing (default, blackwell)",
    "tp": "tensor-parallel ranks for sizing and worker row slicing (default 1, at most 1024)",
    "head_wise": "one row per kv head of the model, within each layer group (needs --model); default one row "
                 "for all heads of a layer group",
    "max_model_len": "tokens of the longest request: sizes each row's pool from --gpu-memory for what such a "
                     "request holds of it, so sliding-window rows take fewer blocks (as `kvcache plan "
                     "--max-model-len` shows; 0 = every row the same blocks)",
    "max_num_batched_tokens": "tokens a step runs across all requests (decodes included), for sizing with "
                              "--max-model-len: a window row holds each request's window plus one block, and one "
                              "such budget shared by them all (0 = --max-model-len)",
    "per_request_chunks": "size window rows for a scheduler without one budget across requests: each request's "
                          "window plus a whole --max-num-batched-tokens chunk (as `kvcache plan "
                          "--per-request-chunks`)",
    "enable_prefix_caching": "reuse cached prefixes (default on; --no-enable-prefix-caching turns it off)",
    "hash_algorithm": "prefix hash: sha256 (fast default) or sha256_cbor (byte-identical to vLLM's)",
    "hash_seed": "seed of the prefix hashes (sha256_cbor: vLLM's PYTHONHASHSEED); empty = vLLM's default seed "
                 "for both algorithms, so daemons of one model hash its prompts alike; a secret seed shared by a "
                 "deployment keeps its hashes apart from others' (a journal keeps its root across restarts)",
    "events": "publish KV events in vLLM's format on --events-endpoint",
    "events_format": "KV event encoding: map (vLLM 0.33: events as maps with group_idx, the group's spec kind and "
                     "sliding window and extra_keys, 64-bit int hashes, topic frame in replay) or array (vLLM before "
                     "mid-2026, msgspec array_like structs, 32-byte hashes) (default map)",
    "events_hashes": "block hashes in KV events: int (64-bit, as vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES) or bytes "
                     "(32-byte digests) (default: int for map, bytes for array)",
    "events_groups": "group_idx of KV events: vllm (with --model, as vLLM 0.33 groups that model's layers: equal-size "
                     "groups, one event per group of a row's policy, e.g. Gemma 3's sliding groups 0-5 and full group 6) "
                     "or policy (one group per row policy, in order of first appearance; always so without --model) "
                     "(default vllm)",
    "events_topic": "topic frame of every KV event message (default empty, as vLLM; llm-d's indexer reads "
                    "kv@POD@MODEL)",
    "data_parallel_rank": "this daemon's data-parallel rank, sent in every KV event batch, so a router credits "
                          "each rank's blocks to it (default 0)",
    "metrics_port": "serve Prometheus metrics over HTTP on this port of 127.0.0.1 (0 = off)",
    "max_message_bytes": "largest scheduler message accepted, refused by size before decoding (default 64 MiB)",
    "max_tokens": "most tokens in one operation (default 4,194,304)",
    "max_slots": "batch slots handed to requests (default 65,536)",
    "max_reply_bytes": "largest reply: a message whose reply could be larger is refused before any of it applies "
                       "(default 64 MiB)",
    "replay_buffer": "deltas kept for replay before workers must resync from a snapshot (default 4096)",
    "replay_bytes": "bytes of deltas kept for replay, oldest dropped first (default 256 MiB)",
    "dedupe_window": "replies remembered per client for retried requests (default 1024)",
    "dedupe_bytes": "bytes of replies remembered for retried requests in all, oldest dropped first; a retry whose "
                    "reply was dropped is refused, never applied twice (default 64 MiB)",
    "pub_bytes": "bytes of deltas the PUB socket may hold for a slow subscriber; past that it drops deltas and the "
                 "worker catches up by replay (default 64 MiB)",
    "io_threads": "ZMQ I/O threads: more spread the table-delta fan-out to many subscribers over cores (default 1)",
    "heartbeat_ms": "publish the latest seq after this much silence, so workers notice lost deltas and restarts "
                    "(default 100; 10 to 60000)",
    "journal": "folder of a write-ahead journal: every acknowledged operation survives kill -9 and restart "
               "(empty = none: a restart loses every allocation)",
    "lease_timeout": "seconds a scheduler may stay silent before its requests are freed and reported "
                     "(0 = never; any message, e.g. ping, renews the lease)",
    "curve_server_cert": "the daemon's CURVE secret certificate (from `kvcache keys`): tcp:// sockets then accept "
                         "only the clients in --curve-clients-dir",
    "curve_clients_dir": "folder of allowed clients' public certificates (`kvcache keys` writes DIR/clients); "
                         "read again on SIGHUP, which also cuts off the open connections of revoked clients "
                         "(`kvcache keys revoke`)",
    "snapshot_bytes": "compact the journal into a snapshot when its log passes this many bytes (default 256 MiB)",
    "role": "PD disaggregation: prefill (admits with a decode destination, its messagers send), decode "
            "(reserves blocks that prefill writes), or both (default: no PD ops)",
    "transfer_timeout": "seconds a PD reservation or transfer may take before it is released on this daemon and "
                        "reported failed (default 30; an op may give its own timeout)",
    "host_memory": "host memory of the node for a host tier under the GPU blocks, e.g. 64GiB (needs --model to "
                   "size a block; every TP rank's agent keeps its kv heads' part): freed cached blocks are copied "
                   "there and a later prefix hit copies them back (0 = no host tier)",
    "host_block_budget": "host blocks of the host tier, instead of --host-memory (0 = from --host-memory)",
    "tier_timeout": "seconds every rank's agent has to report an ordered host-tier copy before it counts as failed "
                    "(default 30)",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `kvcache serve` with one flag per ServeConfig field."""
    p = sub.add_parser("serve", help="run the cache daemon", description="Run the KV cache daemon: schedulers "
                       "send steps of operations, workers subscribe to block-table deltas.", allow_abbrev=False)
    p.add_argument("--config", metavar="TOML", help="read settings from a TOML file (flags given here win)")
    for f in dataclasses.fields(ServeConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=HELP[f.name])
        else:
            kind = {"int": int, "float": float}.get(str(f.type), str)
            p.add_argument(flag, dest=f.name, type=kind, default=None, help=HELP[f.name])
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    p.set_defaults(run=_run)


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """Defaults, then the TOML file, then flags."""
    values: dict[str, Any] = load_toml(args.config) if args.config else {}
    for f in dataclasses.fields(ServeConfig):
        given = getattr(args, f.name, None)
        if given is not None:
            values[f.name] = given
    try:
        return ServeConfig(**values)
    except TypeError as exc:
        raise KVCacheError(f"--config: {exc}") from None


def build_manager(cfg: ServeConfig) -> tuple[KVCacheManager, tuple[Row, ...] | None, dict[str, Any]]:
    """The manager, its rows' cells (None where no model says which layers and kv heads they hold) and extra info
    (geometry) a config describes.

    With ``--model`` and no ``--rows`` the rows are the config's: layer groups (sliding layers in one row, full
    layers in another), per kv head with ``--head-wise``. ``--num-blocks`` gives every row that many blocks;
    sized from ``--gpu-memory``, each row's pool is in proportion to what a request of ``--max-model-len``
    tokens holds of it (``kvcache plan`` shows the same sizes), or all equal without it.
    """
    extra: dict[str, Any] = {"tp_size": cfg.tp}
    spec = None
    if cfg.model:
        from kvcache.examples import example_models, load_example

        source: Any = load_example(cfg.model) if cfg.model in example_models() else cfg.model
        fields: dict[str, Any] = {"block_size": cfg.block_size, "quant": cfg.quant, "scale_layout": cfg.scale_layout,
                                  "tp_size": cfg.tp}
        if cfg.dtype:
            fields["dtype"] = cfg.dtype
        spec = CacheSpec.from_hf_config(source, head_wise=cfg.head_wise, **fields)
        extra["num_kv_heads"] = spec.num_kv_heads
        extra["num_layers"] = spec.num_layers
    elif cfg.head_wise:
        raise KVCacheError("head_wise: needs --model to know the kv heads")
    layout = None if spec is None else _model_layout(spec, cfg)
    policies = [r.policy for r in layout] if layout is not None else parse_rows(cfg.rows)
    num_blocks, row_blocks, plan = _pool_sizes(cfg, spec, layout)
    if plan is not None and plan.load is not None:
        # The plan's concurrency: requests of --max-model-len tokens its pools hold at once (kvcache plan's bound).
        extra["max_model_len"] = plan.load.max_model_len
        extra["max_concurrency"] = plan.max_concurrency
    pools = len(set(policies))  # rows of equal policies share a pool
    if num_blocks * pools > MAX_BLOCKS:  # before the manager allocates ~20 bytes per pair
        source = "num_blocks" if cfg.num_blocks else "gpu_memory"
        raise KVCacheError(f"{source}: {num_blocks} blocks in each of {pools} row pool(s) make {num_blocks * pools} "
                           f"(pool, block) pairs, more than the {MAX_BLOCKS} a daemon holds"
                           + ("" if cfg.num_blocks else "; lower --gpu-memory or raise --block-size"))
    if spec is not None and layout is not None:
        blocks = row_blocks or [num_blocks] * len(layout)
        mine = rows_of_rank(layout, spec.num_kv_heads or 1, spec.tp_size, 0)
        extra["cache_bytes_per_rank"] = sum(spec.row_bytes_per_block(layout[i]) * blocks[i] for i in mine)
    if layout is not None and cfg.events_groups == "vllm":
        # Each row group's KV events go out under vLLM's group numbers for the model (kvcache.allocator.groups).
        extra["event_groups"] = [list(numbers) for numbers in vllm_group_numbers(layout, policies)]
    manager = KVCacheManager(num_blocks, cfg.block_size, policies, enable_prefix_caching=cfg.enable_prefix_caching,
                             hash_algorithm=cfg.hash_algorithm, hash_seed=cfg.hash_seed or None,
                             enable_events=cfg.events, row_blocks=row_blocks)
    host_blocks = _host_blocks(cfg, spec)
    if host_blocks:
        from kvcache.host_tier import DaemonTier

        # A decode daemon's reserved blocks are written by the prefill node, outside the workers' order.
        manager.attach_tier(DaemonTier(manager, host_blocks, cfg.tp, unordered_writes=cfg.role == "decode"))
    return manager, layout, extra


def _host_blocks(cfg: ServeConfig, spec: CacheSpec | None) -> int:
    """Blocks of the host tier: ``--host-block-budget``, or ``--host-memory`` over a block of every rank (0 = none)."""
    memory = parse_size(cfg.host_memory, "--host-memory")
    if cfg.host_block_budget:
        if memory:
            raise KVCacheError("host_block_budget: gives the host tier's size, as --host-memory does; drop one")
        return cfg.host_block_budget  # at most MAX_BLOCKS (ServeConfig)
    if not memory:
        return 0
    if spec is None:
        raise KVCacheError("host_memory: needs --model to know a block's bytes; or give --host-block-budget")
    blocks = memory // (spec.bytes_per_block * cfg.tp)
    if blocks < 1:
        raise KVCacheError(f"host_memory: {memory:,} bytes hold no block of {spec.bytes_per_block * cfg.tp:,} bytes "
                           f"(every rank's part)")
    if blocks > MAX_BLOCKS:
        raise KVCacheError(f"host_memory: {memory:,} bytes hold {blocks} blocks, more than the {MAX_BLOCKS} a host "
                           f"tier holds")
    return int(blocks)


def _model_layout(spec: CacheSpec, cfg: ServeConfig) -> tuple[Row, ...]:
    """The rows' cells: the config's (``spec.row_layout``), or ``--rows`` as one row or one per kv head."""
    assert spec.num_kv_heads is not None
    if cfg.rows == "full":
        return spec.row_layout
    heads, layers = spec.num_kv_heads, tuple(range(spec.num_layers))
    policies = parse_rows(cfg.rows, heads if cfg.head_wise else None)
    if len(policies) == 1:
        return (Row(policies[0], layers, tuple(range(heads))),)
    if len(policies) != heads:
        raise KVCacheError(f"rows: {len(policies)} policies given; with --model give one (every cell) or one per "
                           f"kv head ({heads})")
    return tuple(Row(p, layers, (h,)) for h, p in enumerate(policies))


def _pool_sizes(cfg: ServeConfig, spec: CacheSpec | None,
                layout: tuple[Row, ...] | None) -> tuple[int, list[int] | None, Plan | None]:
    """Blocks of the id space, each row's pool (None: every row holds all of them) and the plan that sized them
    (None with --num-blocks)."""
    if cfg.num_blocks > 0:
        if cfg.max_model_len:
            raise KVCacheError("max_model_len: sizes each row's pool from --gpu-memory; with --num-blocks every row "
                               "holds that many blocks (drop one of the two)")
        return cfg.num_blocks, None, None
    if spec is None or layout is None:
        raise KVCacheError("num_blocks: give --num-blocks, or --model with --gpu-memory to size the cache")
    gpu_memory = parse_size(cfg.gpu_memory, "--gpu-memory")
    reserve = parse_size(cfg.reserve, "--reserve")
    load = None
    if cfg.max_model_len:
        load = Load(cfg.max_model_len, 1, cfg.max_num_batched_tokens or cfg.max_model_len, cfg.per_request_chunks)
    elif cfg.per_request_chunks:
        raise KVCacheError("per_request_chunks: sizes the rows' pools for --max-model-len; give it too")
    plan = make_plan(dataclasses.replace(spec, rows=layout), gpu_memory=gpu_memory, utilization=cfg.utilization,
                     reserve=reserve, load=load)
    if load is None:
        return plan.num_blocks, None, plan
    sizes = [r.num_blocks for r in plan.rows]
    if min(sizes) < 1:
        raise KVCacheError("gpu_memory: the budget gives a row no block; lower --max-model-len or raise --gpu-memory")
    return max(sizes), sizes, plan


def _run(args: argparse.Namespace) -> int:
    # SIGHUP (read the clients' keys again) first, before anything that takes time: its default action ends the
    # process, and a start takes seconds (a journal's recovery). One during the start is kept for the first turn of
    # the loop; the start reads the folder anyway.
    reload_asked: list[int] = []
    server: Any = None

    def reload(_signum: int, _frame: Any) -> None:
        if server is None:
            reload_asked.append(1)
        else:
            server.request_reload()

    signal.signal(signal.SIGHUP, reload)
    import zmq

    from kvcache.server import CacheServer

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log = logging.getLogger("kvcache.serve")
    cfg = config_from_args(args).resolved()
    manager, layout, extra = build_manager(cfg)
    context = zmq.Context(io_threads=cfg.io_threads)
    try:
        server = CacheServer(cfg, manager, layout=layout, context=context, extra_info=extra)
    except BaseException:  # a refused start (an endpoint in use, a bad key) leaves no thread behind
        context.destroy(linger=0)
        raise
    stopping: list[int] = []

    def stop(signum: int, _frame: Any) -> None:
        stopping.append(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    if reload_asked:
        server.request_reload()
    log.info("configuration:\n%s", cfg.describe())
    endpoints = (cfg.endpoint, cfg.pub_endpoint, cfg.replay_endpoint, cfg.events_endpoint, cfg.events_replay_endpoint)
    if any(e.startswith("tcp://") for e in endpoints) and not cfg.curve_server_cert:
        log.warning("tcp endpoint without --curve-server-cert: anyone who can reach it can change allocations")
    if not cfg.journal:
        log.warning("no journal: a restart loses every allocation (workers reload their tables from the new daemon)")
    print(f"kvcache serve: ready endpoint={cfg.endpoint} pub={cfg.pub_endpoint} replay={cfg.replay_endpoint} "
          f"num_blocks={manager.num_blocks} rows={manager.num_rows} role={cfg.role}"
          + (f" max_concurrency={extra['max_concurrency']}" if "max_concurrency" in extra else "")
          + f" pid={os.getpid()}", flush=True)
    try:
        server.serve(lambda: bool(stopping))
    finally:
        server.close()
        context.destroy(linger=0)  # the server closed its sockets; anything left (a monitor) must not block exit
        log.info("stopped (signal %s)", stopping[0] if stopping else "none")
    return 0
