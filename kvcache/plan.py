"""`kvcache plan`: how many KV blocks and tokens fit a GPU (and host) memory budget."""
from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.layout import CacheSpec
from kvcache.allocator.rows import Row, rows_of_rank
from kvcache.allocator.swa import Full, Window
from kvcache.arguments import add_spec_arguments, positive_int, spec_from_args
from kvcache.units import format_bytes, parse_size


@dataclasses.dataclass(frozen=True, slots=True)
class RowPlan:
    """One row's pool: what a block of it takes, what one request holds of it at most, and its blocks."""

    row: Row
    bytes_per_block: int
    blocks_per_request: int
    num_blocks: int


@dataclasses.dataclass(frozen=True, slots=True)
class Load:
    """The concurrent load a plan is sized for, as vLLM names it: requests of ``max_model_len`` tokens, prefilled
    ``max_num_batched_tokens`` at a time, ``max_num_seqs`` of them at once."""

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """A sized cache: the spec, the per-rank budget and the blocks it holds."""

    spec: CacheSpec
    model: str
    budget_bytes: int
    num_blocks: int
    host_budget_bytes: int | None = None
    host_num_blocks: int | None = None
    load: Load | None = None
    rows: tuple[RowPlan, ...] = ()
    max_concurrency: int | None = None  # requests of max_model_len tokens the rows' pools hold at once
    uniform_concurrency: int | None = None  # the same with every layer full (one row)

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
    load: Load | None = None,
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
    plan = Plan(spec, model, budget, spec.num_blocks_for(budget), host_memory, host_blocks)
    return plan if load is None else size_rows(plan, load)


def blocks_per_request(row: Row, block_size: int, load: Load) -> int:
    """The most blocks of ``row`` one request of ``load.max_model_len`` tokens holds at once.

    A full row holds every block of the request. A window row ``Window(W, S)`` holds its sink blocks
    and the blocks its queries still read: a prefill chunk of ``max_num_batched_tokens`` reads the
    ``W - 1`` keys before it, so ``cdiv(S, B) + cdiv(W - 1 + chunk, B) + 1`` (one block of slack for a
    boundary), never more than the whole request.
    """
    whole = -(-load.max_model_len // block_size)
    policy = row.policy
    if not isinstance(policy, Window):
        return whole
    chunk = min(load.max_num_batched_tokens, load.max_model_len)
    live = -(-policy.sink_tokens // block_size) + -(-(policy.window_tokens - 1 + chunk) // block_size) + 1
    return min(whole, live)


def size_rows(plan: Plan, load: Load) -> Plan:
    """Give each row a pool in proportion to what a request holds of it, filling the budget: the concurrency
    the rows reach, against one full row over every layer (the uniform layout) in the same budget.

    A layer's cache tensors have one block count, so rows that share a layer (a layer's window heads and its
    full heads) get one pool size: the most any of them holds per request.
    """
    spec = plan.spec
    layout = spec.row_layout
    held = [blocks_per_request(row, spec.block_size, load) for row in layout]
    for members in _sharing_layers(layout):
        most = max(held[i] for i in members)
        for i in members:
            held[i] = most
    per_row = [(row, spec.row_bytes_per_block(row), n) for row, n in zip(layout, held)]
    # The budget is one rank's: count the rows rank 0 holds (head-wise rows of other ranks' heads live there).
    assert spec.num_kv_heads is not None
    mine = rows_of_rank(spec.row_layout, spec.num_kv_heads, spec.tp_size, 0)
    per_request = sum(per_row[i][1] * per_row[i][2] for i in mine)
    concurrency = plan.budget_bytes // per_request
    scale = plan.budget_bytes / per_request
    rows = tuple(RowPlan(row, b, n, int(n * scale)) for row, b, n in per_row)
    uniform = plan.budget_bytes // (-(-load.max_model_len // spec.block_size) * spec.bytes_per_block)
    return dataclasses.replace(plan, load=load, rows=rows, max_concurrency=concurrency, uniform_concurrency=uniform)


def _sharing_layers(rows: tuple[Row, ...]) -> list[list[int]]:
    """The rows grouped so that rows with a layer in common (directly or through others) are together."""
    parent = list(range(len(rows)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[int, int] = {}
    for i, row in enumerate(rows):
        for layer in row.layers:
            j = owner.setdefault(layer, i)
            parent[root(i)] = root(j)
    groups: dict[int, list[int]] = {}
    for i in range(len(rows)):
        groups.setdefault(root(i), []).append(i)
    return list(groups.values())


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
    out["rows"] = [{**rp.row.describe(), "bytes_per_block": rp.bytes_per_block,
                    "blocks_per_request": rp.blocks_per_request, "blocks": rp.num_blocks,
                    "bytes": rp.num_blocks * rp.bytes_per_block,
                    "tensors": [{"name": t.name, "shape": list(t.shape(rp.num_blocks)), "dtype": t.dtype}
                                for t in spec.row_tensors(rp.row)]} for rp in plan.rows] or [
        {**row.describe(), "bytes_per_block": spec.row_bytes_per_block(row)} for row in spec.row_layout]
    if plan.load is not None:
        out["load"] = dataclasses.asdict(plan.load)
        out["max_concurrency"] = plan.max_concurrency
        out["uniform_concurrency"] = plan.uniform_concurrency
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
        f"per-layer tensors on one rank ({n:,} blocks, one pool for every layer and kv head):",
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
    if plan.load is not None:
        load = plan.load
        summary += [
            (f"requests of {load.max_model_len:,} tokens at once (rows)", f"{plan.max_concurrency:,}"
             + ("" if (plan.max_concurrency or 0) >= load.max_num_seqs else f" (fewer than --max-num-seqs "
                                                                           f"{load.max_num_seqs})")),
            ("the same with every layer full", f"{plan.uniform_concurrency:,}"),
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
    lines += ["", *render_rows(plan)]
    return "\n".join(lines)


def render_rows(plan: Plan) -> list[str]:
    """The rows: cells, policy, bytes per block, and with a load each row's pool."""
    spec = plan.spec
    head = ["row", "policy", "layers", "kv heads", "bytes/block"]
    if plan.rows:
        head += ["blocks/request", "blocks", "bytes"]
    table = [head]
    for i, row in enumerate(spec.row_layout):
        policy = ("full" if isinstance(row.policy, Full) else
                  f"window {row.policy.window_tokens}" + (f" + sink {row.policy.sink_tokens}"
                                                          if row.policy.sink_tokens else ""))
        cells = [str(i), policy, _ranges(row.layers), _ranges(row.kv_heads), f"{spec.row_bytes_per_block(row):,}"]
        if plan.rows:
            rp = plan.rows[i]
            cells += [f"{rp.blocks_per_request:,}", f"{rp.num_blocks:,}", format_bytes(rp.num_blocks * rp.bytes_per_block)]
        table.append(cells)
    tensors = []
    if plan.rows:  # each row's layers hold tensors of its own pool size
        tensors.append("per-layer tensors of each row on one rank (a row's pool, its kv heads):")
        for i, rp in enumerate(plan.rows):
            shapes = ", ".join(f"{t.name} [{', '.join(str(d) for d in t.shape(rp.num_blocks))}] {t.dtype}"
                               for t in spec.row_tensors(rp.row))
            tensors.append(f"  row {i}, each of its {len(rp.row.layers)} layers: {shapes}")
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    title = (f"rows ({len(spec.row_layout)}; pools sized for requests of {plan.load.max_model_len:,} tokens, "
             f"prefill chunks of {plan.load.max_num_batched_tokens:,}):" if plan.load else
             f"rows ({len(spec.row_layout)}; give --max-model-len to size a pool per row):")
    return [title, *("  " + "  ".join(c.ljust(w) if j < 4 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths)))
                     for r in table), *tensors]


def _ranges(values: tuple[int, ...]) -> str:
    """0-3,5,7-9: ascending ints as runs."""
    runs: list[str] = []
    start = prev = values[0]
    for v in (*values[1:], None):
        if v is not None and v == prev + 1:
            prev = v
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ",".join(runs)


def _run_plan(args: argparse.Namespace) -> int:
    spec, name = spec_from_args(args)
    load = None
    if args.max_model_len is not None:
        load = Load(args.max_model_len, args.max_num_seqs, args.max_num_batched_tokens or args.max_model_len)
    plan = make_plan(
        spec,
        gpu_memory=parse_size(args.gpu_memory, "--gpu-memory"),
        utilization=args.utilization,
        reserve=parse_size(args.reserve, "--reserve"),
        host_memory=None if args.host_memory is None else parse_size(args.host_memory, "--host-memory"),
        model=name,
        load=load,
    )
    print(json.dumps(plan_json(plan), indent=2) if args.json else render_plan(plan))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `kvcache plan`."""
    p = sub.add_parser(
        "plan",
        allow_abbrev=False,
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
    load = p.add_argument_group("load (as vLLM names it): size a pool per row for it")
    load.add_argument("--max-model-len", type=positive_int, metavar="TOKENS",
                      help="tokens of the longest request; gives each row a pool and reports how many such requests "
                      "fit at once, against every layer full")
    load.add_argument("--max-num-seqs", type=positive_int, default=256, metavar="N",
                      help="requests the engine runs at once (default 256): the plan says when fewer fit")
    load.add_argument("--max-num-batched-tokens", type=positive_int, metavar="TOKENS",
                      help="prefill chunk: a window row holds the window plus one chunk (default: the whole "
                      "request in one chunk)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(run=_run_plan)
