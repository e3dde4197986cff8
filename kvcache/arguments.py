"""argparse pieces the subcommands share: a model's cache geometry, and how a tool reaches a running daemon."""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.layout import MODEL_DTYPES, CacheSpec, QuantType, ScaleLayout, check_bounds
from kvcache.examples import DEFAULT_EXAMPLE, example_models, load_example

if TYPE_CHECKING:
    from kvcache.client import CacheClient

MAX_TIMEOUT = 86_400  # seconds a tool waits for each answer of a daemon, at most (a day)


def add_spec_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags that describe a model's KV cache: a config file, an example, or explicit geometry."""
    source = parser.add_argument_group("model (one of --model, --example, or explicit geometry)")
    source.add_argument("--model", metavar="PATH", help="Hugging Face config.json, or a folder holding one")
    source.add_argument(
        "--example",
        metavar="NAME",
        help=f"a built-in model config: {', '.join(example_models())} (default {DEFAULT_EXAMPLE} "
        "when no geometry is given)",
    )
    source.add_argument("--layers", type=int, help="number of attention layers")
    source.add_argument("--kv-heads", type=int, help="kv heads of the whole model (before tensor parallelism)")
    source.add_argument("--head-dim", type=int, help="size of one K head")
    source.add_argument("--head-dim-v", type=int, help="size of one V head when it differs from --head-dim")
    source.add_argument("--kv-lora-rank", type=int, help="MLA latent rank (DeepSeek-style models)")
    source.add_argument("--rope-dim", type=int, help="MLA rope part of the latent (qk_rope_head_dim)")
    cache = parser.add_argument_group("cache")
    cache.add_argument("--block-size", type=int, default=64, help="tokens per block (default 64)")
    cache.add_argument(
        "--dtype",
        choices=MODEL_DTYPES,
        help="model dtype of unquantised values and scales (default: the config's torch_dtype, else bfloat16)",
    )
    cache.add_argument(
        "--quant",
        default="none",
        choices=[q.value for q in QuantType],
        help="how KV values are stored (default none; on an MLA model none/fp8 mean mla/mla_fp8)",
    )
    cache.add_argument(
        "--scale-layout",
        default="default",
        choices=[s.value for s in ScaleLayout],
        help="block_wise_fp8 scale tensors: default [blocks, heads, block_size] in the model dtype, "
        "blackwell [blocks, heads, 4] float32",
    )
    cache.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks the kv heads are split over")
    cache.add_argument("--head-wise", action="store_true",
                       help="one row per kv head within each layer group (default: one row per layer group; a "
                       "model without sliding windows has one)")


def add_daemon_arguments(parser: argparse.ArgumentParser, timeout: float = 3.0) -> None:
    """Flags of a tool that talks to a running daemon: its endpoint (as `kvcache serve` names it), CURVE keys for a
    tcp:// daemon started with --curve-server-cert, and a deadline per request."""
    group = parser.add_argument_group("daemon")
    group.add_argument("--endpoint", default="", help="the daemon's scheduler endpoint, ipc://PATH or "
                       "tcp://HOST:PORT (default: the default of `kvcache serve`)")
    group.add_argument("--curve-client-cert", metavar="FILE", help="this client's CURVE secret certificate "
                       "(NAME.key_secret from `kvcache keys`), for a tcp:// daemon with --curve-server-cert")
    group.add_argument("--curve-server-public", metavar="FILE", help="the daemon's CURVE public certificate "
                       "(server.key from `kvcache keys`), with --curve-client-cert")
    group.add_argument("--timeout", type=float, default=timeout, metavar="SECONDS",
                       help=f"seconds to wait for each answer of the daemon (default {timeout:g})")


def client_from_args(args: argparse.Namespace) -> CacheClient:
    """A CacheClient for the daemon that ``add_daemon_arguments``' flags name."""
    from kvcache.auth import CurveConfig
    from kvcache.client import CacheClient
    from kvcache.config import ServeConfig

    if (args.curve_client_cert is None) != (args.curve_server_public is None):
        raise KVCacheError("--curve-client-cert and --curve-server-public: give both (a client's secret "
                           "certificate and the daemon's public one) or neither")
    curve = None
    if args.curve_client_cert is not None:
        curve = CurveConfig.for_client(args.curve_client_cert, args.curve_server_public)
    if not 0 < args.timeout <= MAX_TIMEOUT:  # NaN too; the socket takes whole milliseconds in a C int
        raise KVCacheError(f"--timeout: must be positive seconds, at most {MAX_TIMEOUT}, got {args.timeout:g}")
    return CacheClient(args.endpoint or ServeConfig().resolved().endpoint, timeout=args.timeout, curve=curve)


def spec_from_args(args: argparse.Namespace) -> tuple[CacheSpec, str]:
    """Build the CacheSpec the flags describe, and a name for it."""
    explicit = {
        "num_layers": args.layers,
        "num_kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "head_dim_v": args.head_dim_v,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_rope_head_dim": args.rope_dim,
    }
    given = {k: v for k, v in explicit.items() if v is not None}
    common: dict[str, Any] = {
        "block_size": args.block_size,
        "quant": args.quant,
        "scale_layout": args.scale_layout,
        "tp_size": args.tp,
    }
    if args.dtype:
        common["dtype"] = args.dtype
    if args.model and args.example:
        raise KVCacheError("--model and --example: give one of them, not both")
    if args.model or args.example or not given:
        name = args.model or args.example or DEFAULT_EXAMPLE
        config = args.model or load_example(name)
        return CacheSpec.from_hf_config(config, head_wise=args.head_wise, **common, **given), name
    if "num_layers" not in given:
        raise KVCacheError("--layers: needed with explicit geometry (or use --model/--example)")
    if args.head_wise:
        raise KVCacheError("--head-wise: needs --model or --example (the rows come from the model's config)")
    check_bounds({**common, **given})  # before the rows and tables a spec's layers and heads make
    return CacheSpec(**common, **given), "custom"


def _int_at_least(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int_at_least(text, 1)


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int_at_least(text, 0)
