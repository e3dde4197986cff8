"""`kvcache plan`: how many KV blocks and tokens fit a GPU (and host) memory budget, and each row's pool.

A full row holds every block of every request. A sliding-window row ``Window(W, S)`` holds far less, and how much
follows from when ``allocator/swa.py`` gives blocks back. A step gives request r a chunk of ``c`` tokens from
``T`` on (``T`` computed). First its window row gives back every block wholly below token ``T - W + 1`` past the
sink (``recyclable_blocks``: no query from ``T`` on reads them); then it takes blocks through token ``T + c - 1``.
So after the step r holds its ``cdiv(S, B)`` sink blocks and blocks ``[(T - W + 1) // B, cdiv(T + c, B))``, the
most where ``T - W + 1`` is a block's last slot (B = 4, W = 6, c = 3, T = 8; ``w`` read, ``c`` written)::

    token   0 1 2 3 | 4 5 6 7 | 8 9 10 11
    block   0       | 1       | 2
            . . . w | w w w w | c c  c  .       held: 3 blocks = 1 + cdiv(W - 2 + c, B)

    held(c) = cdiv(S, B) + 1 + cdiv(W - 2 + c, B), at most whole = cdiv(max_model_len, B)

``held(0)`` is a request's window plus one partly filled block. One step runs at most ``N =
max_num_batched_tokens`` tokens across all requests (decodes count too), so the chunks add up to at most ``N``.
A request's first block past ``held(0)`` costs ``d`` tokens (those that carry ``W - 2`` over a block boundary, 1 to
``B``), each further one ``B`` more, so ``n`` requests hold at most::

    n * held(0)  +  k + min((N - k * d) // B, k * (whole - held(0) - 1)),   k = min(n, N // d)
    |per request |  |one budget's worth of blocks, shared by all requests|

and a schedule reaches it: every request at such a ``T``, ``k`` of them given ``d`` tokens, one the rest. Gemma 3
27B (W = 1,024, B = 16, N = 8,192): 65 blocks a request plus 530 shared by 23 requests, where sizing every
request for a whole chunk (577 blocks each) fits 11.

The bound holds while the chunks the requests were last extended by add up to one budget: a step gives back
before it takes. A scheduler meets that by extending every running request every step in one fixed order, tokens
handed out first come, first served and new requests last (vLLM's order; ``extend(req, [])`` for a request given
none only gives back): a running request takes more than last step only where the budget ran out at it last step,
and then no later one took any. Or it gives every running request's dead blocks back (``extend(req, [])``) before
the step's first new block.
A chunked row ``Chunked(C)`` (C a multiple of B) gives back every block before ``T``'s chunk, so it holds blocks
``[(T // C) * C // B, cdiv(T + c, B))``, the most where ``T`` is a chunk's last token: the bound above with
``held(c) = cdiv(C - 1 + c, B)`` (one chunk, at most), a chunk's ``C - 1`` carried over as a window's ``W - 2``.
A scheduler that keeps a step in flight (``num_computed_tokens`` a step behind) holds two steps' chunks: plan it
with twice the budget. ``Load.per_request_chunks`` (``--per-request-chunks``) sizes for a scheduler with no global
budget: every request may hold ``held(chunk)`` at once.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.layout import CacheSpec
from kvcache.allocator.rows import Row, rows_of_rank
from kvcache.allocator.swa import AttentionPolicy, Chunked, Full, LocalPolicy
from kvcache.arguments import add_spec_arguments, positive_int, spec_from_args
from kvcache.units import format_bytes, parse_size

_MOST_REQUESTS = 1 << 40  # where the concurrency search stops (a row of one-token windows at block 1 costs nothing)


@dataclasses.dataclass(frozen=True, slots=True)
class RowPlan:
    """One row's pool: what a block of it takes, what one request holds of it at most, and its blocks.

    ``blocks_per_step``: what the planned requests hold of it beyond ``blocks_per_request`` each, together (a
    window row's share of one step's chunks; 0 for a full row and with ``per_request_chunks``).
    """

    row: Row
    bytes_per_block: int
    blocks_per_request: int
    num_blocks: int
    blocks_per_step: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Load:
    """The concurrent load a plan is sized for, as vLLM names it: requests of ``max_model_len`` tokens, steps of at
    most ``max_num_batched_tokens`` tokens across all of them (decodes count), ``max_num_seqs`` of them at once.

    ``per_request_chunks``: the scheduler keeps no budget across requests, so each may prefill a chunk of
    ``max_num_batched_tokens`` in the same step (the module docstring says what each holds either way).
    """

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    per_request_chunks: bool = False


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


def _cdiv(a: int, b: int) -> int:
    """Ceiling of ``a / b`` for ``b >= 1`` (``a`` may be negative: a window of one token needs no earlier key)."""
    return -(-a // b)


def _carried(policy: LocalPolicy, block_size: int) -> tuple[int, int]:
    """(blocks held whatever the chunk, tokens before the chunk): a window's sink blocks + 1 and ``W - 2``, a chunked
    row's 0 and ``C - 1``, so that ``held(c) = base + cdiv(lead + c, B)``."""
    if isinstance(policy, Chunked):
        return 0, policy.chunk_tokens - 1
    return _cdiv(policy.sink_tokens, block_size) + 1, policy.window_tokens - 2


def window_blocks(policy: LocalPolicy, block_size: int, max_model_len: int, chunk: int) -> int:
    """``held(chunk)`` of the module docstring: the most blocks of a ``policy`` row one request holds right after a
    step gives it ``chunk`` tokens (its sink, the window before the chunk, the chunk, one block where the window
    starts mid-block; for a chunked row its chunk so far and the step's), never more than the whole request."""
    base, lead = _carried(policy, block_size)
    return min(_cdiv(max_model_len, block_size), base + _cdiv(lead + chunk, block_size))


def blocks_per_request(policy: AttentionPolicy, block_size: int, load: Load) -> int:
    """The most blocks of a ``policy`` row one request of ``load`` holds by itself: all of them for a full row; for a
    window row ``held(0)``, or ``held(chunk)`` with ``load.per_request_chunks``."""
    if isinstance(policy, Full):
        return _cdiv(load.max_model_len, block_size)
    chunk = min(load.max_num_batched_tokens, load.max_model_len) if load.per_request_chunks else 0
    return window_blocks(policy, block_size, load.max_model_len, chunk)


def row_blocks(policy: AttentionPolicy, block_size: int, load: Load, num_requests: int) -> int:
    """The most blocks of a ``policy`` row that ``num_requests`` requests of ``load`` hold at once: the module
    docstring's bound, exact (a schedule within the budget reaches it)."""
    each = blocks_per_request(policy, block_size, load)
    whole = _cdiv(load.max_model_len, block_size)
    if isinstance(policy, Full) or load.per_request_chunks or each >= whole or num_requests == 0:
        return num_requests * each
    lead = _carried(policy, block_size)[1]
    first = _cdiv(lead, block_size) * block_size - lead + 1  # d: the tokens that open a request's next block
    budget = load.max_num_batched_tokens
    opened = min(num_requests, budget // first)  # k: requests given their first block past held(0)
    return num_requests * each + opened + min((budget - opened * first) // block_size, opened * (whole - each - 1))


def size_rows(plan: Plan, load: Load) -> Plan:
    """Give each row the pool the most requests that fit the budget need of it (``row_blocks``), and the budget
    left over in proportion to what one request more would add: the concurrency the rows reach, against one full
    row over every layer (the uniform layout) in the same budget.

    A layer's cache tensors have one block count, so rows that share a layer (a layer's window heads and its
    full heads) get one pool size: the most any of them needs.
    """
    spec = plan.spec
    layout, bs = spec.row_layout, spec.block_size
    shared = _sharing_layers(layout)
    per_block = [spec.row_bytes_per_block(row) for row in layout]
    # The budget is one rank's: count the rows rank 0 holds (head-wise rows of other ranks' heads live there).
    assert spec.num_kv_heads is not None
    mine = rows_of_rank(layout, spec.num_kv_heads, spec.tp_size, 0)

    def needs(n: int) -> list[tuple[int, int]]:
        """(blocks per request, blocks) each row's pool needs for ``n`` requests, shared-layer rows at their most."""
        out = [(blocks_per_request(row.policy, bs, load), row_blocks(row.policy, bs, load, n)) for row in layout]
        for members in shared:
            most = max((out[i] for i in members), key=lambda need: need[1])
            for i in members:
                out[i] = most
        return out

    def cost(n: int) -> int:
        held = needs(n)
        return sum(per_block[i] * held[i][1] for i in mine)

    low, high = 0, 1  # cost(low) fits the budget; find a high that does not, then halve
    while cost(high) <= plan.budget_bytes and high < _MOST_REQUESTS:
        low, high = high, 2 * high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if cost(mid) <= plan.budget_bytes else (low, mid)
    now, then = needs(low), needs(low + 1)
    more = cost(low + 1) - cost(low)
    spare = (plan.budget_bytes - cost(low)) / more if more else 0.0  # < 1: a part of one request more
    rows = tuple(RowPlan(row, per_block[i], now[i][0], held + int(spare * (then[i][1] - held)),
                         held - low * now[i][0])
                 for i, (row, (_, held)) in enumerate(zip(layout, now)))
    uniform = plan.budget_bytes // (_cdiv(load.max_model_len, bs) * spec.bytes_per_block)
    return dataclasses.replace(plan, load=load, rows=rows, max_concurrency=low, uniform_concurrency=uniform)


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
                    "blocks_per_request": rp.blocks_per_request, "blocks_per_step": rp.blocks_per_step,
                    "blocks": rp.num_blocks,
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
        head += ["blocks/request", "blocks/step", "blocks", "bytes"]
    table = [head]
    for i, row in enumerate(spec.row_layout):
        policy = ("full" if isinstance(row.policy, Full) else f"chunk {row.policy.chunk_tokens}"
                  if isinstance(row.policy, Chunked) else
                  f"window {row.policy.window_tokens}" + (f" + sink {row.policy.sink_tokens}"
                                                          if row.policy.sink_tokens else ""))
        cells = [str(i), policy, _ranges(row.layers), _ranges(row.kv_heads), f"{spec.row_bytes_per_block(row):,}"]
        if plan.rows:
            rp = plan.rows[i]
            cells += [f"{rp.blocks_per_request:,}", f"{rp.blocks_per_step:,}", f"{rp.num_blocks:,}",
                      format_bytes(rp.num_blocks * rp.bytes_per_block)]
        table.append(cells)
    tensors = []
    if plan.rows:  # each row's layers hold tensors of its own pool size
        tensors.append("per-layer tensors of each row on one rank (a row's pool, its kv heads):")
        for i, rp in enumerate(plan.rows):
            shapes = ", ".join(f"{t.name} [{', '.join(str(d) for d in t.shape(rp.num_blocks))}] {t.dtype}"
                               for t in spec.row_tensors(rp.row))
            tensors.append(f"  row {i}, each of its {len(rp.row.layers)} layers: {shapes}")
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    load = plan.load
    title = (f"rows ({len(spec.row_layout)}; give --max-model-len to size a pool per row):" if load is None else
             f"rows ({len(spec.row_layout)}; pools sized for {plan.max_concurrency:,} requests of "
             f"{load.max_model_len:,} tokens, "
             + (f"each prefilling up to {load.max_num_batched_tokens:,} at once):" if load.per_request_chunks else
                f"{load.max_num_batched_tokens:,} tokens a step across them; blocks/step: the rows' share of "
                f"a step, held by all of them together):"))
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


def vllm_comparison(plan: Plan) -> dict[str, Any]:
    """vLLM's own hybrid planner on the plan's layers and budget (``kvcache.bench.vllm.planner_concurrency``: its
    ``get_kv_cache_configs`` and ``get_max_concurrency_for_kv_cache_config``), beside the plan: its requests at
    once, ours over its, and ours again given the tokens vLLM counts in flight. Needs vLLM importable and a plan
    of a bf16 or fp16 cache without quantization, sized for a load."""
    from kvcache.allocator.groups import units_of
    from kvcache.bench import vllm

    spec, load = plan.spec, plan.load
    if load is None or plan.max_concurrency is None:
        raise KVCacheError("--vllm: compares the requests a load fits; give --max-model-len")
    if spec.quant.value != "none" or spec.dtype not in ("bfloat16", "float16"):
        raise KVCacheError(f"--vllm: compares bf16/fp16 caches without quantization, got dtype {spec.dtype}, "
                           f"quant {spec.quant.value}")
    if vllm.version() is None:
        raise KVCacheError("--vllm: vllm is not importable here (../shared/tools/setup-vllm.sh builds an "
                           "environment with vLLM 0.33 on a CPU)")
    assert spec.num_kv_heads is not None and spec.head_dim is not None
    units = units_of(spec.row_layout)
    if units[0][0][1] >= 0 and spec.tp_size > 1:
        raise KVCacheError("--vllm: a config with policies per kv head compares at --tp 1 only")
    kinds = {Full: lambda p: ("full", None), Chunked: lambda p: ("chunk", p.chunk_tokens)}
    named = [(f"layers.{layer}" if head < 0 else f"layers.{layer}.heads.{head}",
              kinds.get(type(policy), lambda p: ("window", p.window_tokens))(policy))
             for (layer, head), policy in units]
    heads = spec.kv_heads_per_rank if units[0][0][1] < 0 else 1
    theirs = vllm.planner_concurrency(named, heads, spec.head_dim, spec.block_size, load.max_model_len,
                                      load.max_num_batched_tokens, plan.budget_bytes)
    in_flight = make_plan(spec, gpu_memory=plan.budget_bytes, utilization=1.0,
                          load=dataclasses.replace(load, max_num_batched_tokens=theirs["max_in_flight_tokens"]))
    return {**theirs, "ours": plan.max_concurrency, "ours_over_vllm": plan.max_concurrency / theirs["max_concurrency"],
            "ours_at_vllm_in_flight": in_flight.max_concurrency,
            "ours_at_vllm_in_flight_over_vllm": (in_flight.max_concurrency or 0) / theirs["max_concurrency"]}


def render_vllm_comparison(c: dict[str, Any]) -> str:
    """The comparison as two lines."""
    return (f"vLLM {c['version']}'s planner (get_kv_cache_configs, get_max_concurrency_for_kv_cache_config), same "
            f"layers and budget: {c['max_concurrency']:.2f} requests at once ({len(c['groups'])} group(s), "
            f"{c['num_blocks']:,} blocks, {c['max_in_flight_tokens']:,} tokens in flight)\n"
            f"kvcache / vLLM: {c['ours_over_vllm']:.2f}x ({c['ours']:,} requests); with vLLM's "
            f"{c['max_in_flight_tokens']:,} tokens in flight: {c['ours_at_vllm_in_flight_over_vllm']:.2f}x "
            f"({c['ours_at_vllm_in_flight']:,})")


def _run_plan(args: argparse.Namespace) -> int:
    spec, name = spec_from_args(args)
    load = None
    if args.max_model_len is not None:
        load = Load(args.max_model_len, args.max_num_seqs, args.max_num_batched_tokens or args.max_model_len,
                    args.per_request_chunks)
    elif args.per_request_chunks:
        raise KVCacheError("--per-request-chunks: sizes the rows' pools for a load; give --max-model-len too")
    plan = make_plan(
        spec,
        gpu_memory=parse_size(args.gpu_memory, "--gpu-memory"),
        utilization=args.utilization,
        reserve=parse_size(args.reserve, "--reserve"),
        host_memory=None if args.host_memory is None else parse_size(args.host_memory, "--host-memory"),
        model=name,
        load=load,
    )
    compared = vllm_comparison(plan) if args.vllm else None
    if args.json:
        print(json.dumps({**plan_json(plan), **({"vllm": compared} if compared else {})}, indent=2))
    else:
        print(render_plan(plan) + ("\n\n" + render_vllm_comparison(compared) if compared else ""))
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
                      help="tokens a step runs across all requests, decodes included: a window row holds each "
                      "request's window plus one block, and one such budget shared by them all (default: "
                      "--max-model-len)")
    load.add_argument("--per-request-chunks", action="store_true",
                      help="for a scheduler without one budget across requests: a window row holds each request's "
                      "window plus a whole --max-num-batched-tokens chunk")
    p.add_argument("--vllm", action="store_true",
                   help="with --max-model-len: also ask the installed vLLM's own hybrid planner (get_kv_cache_configs, "
                   "get_max_concurrency_for_kv_cache_config) how many such requests the same layers and budget fit, "
                   "and print the ratio (bf16/fp16 caches)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(run=_run_plan)
