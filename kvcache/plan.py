"""`kvcache plan`: how many KV blocks and tokens fit a GPU (and host) memory budget."""
from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.layout import CacheSpec
from kvcache.arguments import add_spec_arguments, spec_from_args
from kvcache.units import format_bytes, parse_size


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """A sized cache: the spec, the per-rank budget and the blocks it holds."""

    spec: CacheSpec
    model: str
    budget_bytes: int
    num_blocks: int
    host_budget_bytes: int | None = None
    host_num_blocks: int | None = None

    @property
    def max_tokens(self) -> int:
        return self.num_blocks * self.spec.block_size


def make_plan(
    spec: CacheSpec,
    *,
    gpu_memory: int,
    utilization: float = 0.9,
    reserve: int = 0,
    host_memory: int | None = None,
    model: str = "custom",
) -> Plan:
    """Size the cache: per-rank budget = gpu_memory × utilization − reserve; host memory is per node.

    The host tier keeps every rank's share of a block, so one host block costs
    ``spec.global_bytes_per_block``.
    """
    if not 0.0 < utilization <= 1.0:
        raise KVCacheError(f"utilization: must be in (0, 1], got {utilization}")
    budget = int(gpu_memory * utilization) - reserve
    if budget < spec.bytes_per_block:
        raise KVCacheError(
            f"gpu_memory: budget {format_bytes(budget)} (gpu_memory × utilization − reserve) "
            f"fits no block of {format_bytes(spec.bytes_per_block)}"
        )
    host_blocks = None if host_memory is None else host_memory // spec.global_bytes_per_block
    return Plan(spec, model, budget, spec.num_blocks_for(budget), host_memory, host_blocks)


def plan_json(plan: Plan) -> dict[str, Any]:
    """The plan as one JSON-ready object (sizes in bytes, shapes as lists)."""
    spec = plan.spec
    out: dict[str, Any] = {
        "model": plan.model,
        "spec": spec.describe(),
        "bytes_per_block_per_layer": spec.bytes_per_block_per_layer,
        "bytes_per_block": spec.bytes_per_block,
        "global_bytes_per_block": spec.global_bytes_per_block,
        "bytes_per_token": spec.bytes_per_token,
        "budget_bytes": plan.budget_bytes,
        "num_blocks": plan.num_blocks,
        "max_tokens": plan.max_tokens,
        "cache_bytes": spec.cache_bytes(plan.num_blocks),
        "tensors": [
            {
                "name": t.name,
                "shape": list(t.shape(plan.num_blocks)),
                "dtype": t.dtype,
                "bytes_per_block": t.bytes_per_block,
                "bytes": t.nbytes(plan.num_blocks),
            }
            for t in spec.tensors()
        ],
    }
    if plan.host_num_blocks is not None:
        out["host_budget_bytes"] = plan.host_budget_bytes
        out["host_num_blocks"] = plan.host_num_blocks
        out["host_max_tokens"] = plan.host_num_blocks * spec.block_size
    return out


def render_plan(plan: Plan) -> str:
    """The plan as a readable table."""
    spec, n = plan.spec, plan.num_blocks
    geometry = (
        f"latent {spec.head_dim} (kv_lora_rank {spec.kv_lora_rank} + rope {spec.qk_rope_head_dim})"
        if spec.quant.is_mla
        else f"{spec.num_kv_heads} kv heads × head_dim {spec.head_dim}"
        + (f"/{spec.head_dim_v}" if spec.head_dim_v != spec.head_dim else "")
    )
    scales = f" (scale layout {spec.scale_layout.value})" if spec.quant.value == "block_wise_fp8" else ""
    lines = [
        f"model {plan.model}: {spec.num_layers} layers, {geometry}",
        f"cache: block_size {spec.block_size}, dtype {spec.dtype}, quant {spec.quant.value}{scales}, "
        f"tp {spec.tp_size} ({spec.kv_heads_per_rank} kv head(s) per rank"
        + (f", each on {spec.head_replicas} ranks" if spec.head_replicas > 1 else "")
        + ")",
        "",
        f"per-layer tensors on one rank ({n:,} blocks):",
    ]
    rows = [("tensor", "shape", "dtype", "bytes/block", "bytes")]
    for t in spec.tensors():
        shape = "[" + ", ".join(str(d) for d in t.shape(n)) + "]"
        rows.append((t.name, shape, t.dtype, f"{t.bytes_per_block:,}", format_bytes(t.nbytes(n))))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        lines.append("  " + "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    summary = [
        ("bytes per block per layer", f"{spec.bytes_per_block_per_layer:,}"),
        (f"bytes per block ({spec.num_layers} layers)", f"{spec.bytes_per_block:,}"),
        ("bytes per token (all layers)", f"{spec.bytes_per_token:,.1f}"),
        ("GPU budget per rank", f"{format_bytes(plan.budget_bytes)} ({plan.budget_bytes:,} B)"),
        ("blocks that fit", f"{n:,}"),
        ("tokens that fit", f"{plan.max_tokens:,}"),
        ("cache bytes per rank", f"{format_bytes(spec.cache_bytes(n))}"),
    ]
    if plan.host_num_blocks is not None:
        assert plan.host_budget_bytes is not None
        summary += [
            ("host memory (node, all ranks)", format_bytes(plan.host_budget_bytes)),
            ("host blocks that fit", f"{plan.host_num_blocks:,}"),
            ("host tokens that fit", f"{plan.host_num_blocks * spec.block_size:,}"),
        ]
    key_width = max(len(k) for k, _ in summary)
    lines.append("")
    lines += [f"{k.ljust(key_width)}  {v}" for k, v in summary]
    return "\n".join(lines)


def _run_plan(args: argparse.Namespace) -> int:
    spec, name = spec_from_args(args)
    plan = make_plan(
        spec,
        gpu_memory=parse_size(args.gpu_memory, "--gpu-memory"),
        utilization=args.utilization,
        reserve=parse_size(args.reserve, "--reserve"),
        host_memory=None if args.host_memory is None else parse_size(args.host_memory, "--host-memory"),
        model=name,
    )
    print(json.dumps(plan_json(plan), indent=2) if args.json else render_plan(plan))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `kvcache plan`."""
    p = sub.add_parser(
        "plan",
        help="size a paged KV cache: tensors, bytes per block, blocks and tokens that fit",
        description="Print the per-layer cache tensors of one rank, bytes per block, and how many blocks "
        "and tokens fit a GPU (and optionally host) memory budget.",
    )
    add_spec_arguments(p)
    mem = p.add_argument_group("memory")
    mem.add_argument("--gpu-memory", default="80GiB", help="memory of one GPU, e.g. 80GiB (default 80GiB)")
    mem.add_argument(
        "--utilization", type=float, default=0.9, help="fraction of --gpu-memory the engine may use (default 0.9)"
    )
    mem.add_argument(
        "--reserve",
        default="0",
        help="memory per GPU taken by weights and activations, subtracted from the budget (default 0)",
    )
    mem.add_argument("--host-memory", help="host memory of the node for a host-tier cache, e.g. 512GiB")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(run=_run_plan)
