"""Tensor parallelism for the reference engine: each rank's KV cache and attention in a process of its own.

The scheduler and the dense parts of the model stay in the engine's process;
per layer, each rank gets the query heads and the K and V of the kv heads it
owns (``rank_heads``), stores them in its own ``PagedCache`` through the
tables its own ``TableSubscriber`` follows (the rank's rows: its kv heads'
rows, each layer group's), attends, and sends its heads' output back. So
every rank proves that the daemon's deltas give it exactly its rows.
"""
from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import numpy as np
import paddle

from kvcache.allocator import CacheSpec
from kvcache.transfer.heads import rank_heads

from engine import Item, PagedCache, RankAttention, layer_blocks
from model import Model, ModelConfig


class TPAttention:
    """``attention(layer, q, kv, items)`` over ``tp`` worker processes, each following the daemon at
    ``endpoint`` as TP rank r (its scheduler is ``client``: the workers wait for its last seq)."""

    def __init__(self, config: ModelConfig, endpoint: str, client: Any, tp: int, *, block_size: int,
                 head_wise: bool = False, quant: str = "none", timeout: float = 60.0) -> None:
        if config.kv_lora_rank or config.num_kv_heads % tp:
            raise ValueError(f"tp: {tp} ranks need kv heads they divide (GQA), got {config.num_kv_heads}")
        self.client, self.timeout = client, timeout
        self.heads = [rank_heads(config.num_kv_heads, tp, r) for r in range(tp)]
        self.group = config.num_q_heads // config.num_kv_heads
        ctx = mp.get_context("spawn")
        self.conns, self.processes = [], []
        for rank in range(tp):
            conn, child = ctx.Pipe()
            process = ctx.Process(target=_rank, args=(child, config, endpoint, rank, tp, block_size, head_wise, quant),
                                  daemon=True)
            process.start()
            self.conns.append(conn)
            self.processes.append(process)
        for rank in range(tp):
            self._receive(rank, 120.0)

    def __call__(self, layer: int, q: paddle.Tensor, kv: tuple[paddle.Tensor, ...], items: list[Item]
                 ) -> paddle.Tensor:
        seq = self.client.last_seq
        plain = [(item.rid, item.positions, item.stop) for item in items]
        q_np, kv_np = q.numpy(), [x.numpy() for x in kv]
        for conn, heads in zip(self.conns, self.heads):
            qs = q_np[:, heads.start * self.group:heads.stop * self.group]
            conn.send(("attend", layer, seq, plain, qs, [x[:, heads.start:heads.stop] for x in kv_np]))
        outs = [self._receive(rank, self.timeout) for rank in range(len(self.conns))]
        return paddle.to_tensor(np.concatenate(outs, axis=1))

    def _receive(self, rank: int, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while not self.conns[rank].poll(0.05):
            if not self.processes[rank].is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"TP rank {rank} did not answer (exit code {self.processes[rank].exitcode})")
        kind, value = self.conns[rank].recv()
        if kind == "error":
            raise RuntimeError(f"TP rank {rank}: {value}")
        return value

    def close(self) -> None:
        for conn, process in zip(self.conns, self.processes):
            try:
                conn.send(("stop",))
            except OSError:
                pass
            process.join(10)
            if process.is_alive():
                process.kill()


def _rank(conn: Any, config: ModelConfig, endpoint: str, rank: int, tp: int, block_size: int, head_wise: bool,
          quant: str) -> None:
    """A TP rank: its subscriber, its cache, its attention; answers one layer at a time until told to stop."""
    from kvcache.worker import TableSubscriber

    try:
        spec = CacheSpec.from_hf_config(config.hf_config(), block_size=block_size, head_wise=head_wise,
                                        dtype="float32", quant=quant, tp_size=tp)
        tables = TableSubscriber(endpoint, rank=rank, tp_size=tp, max_slots=64, max_blocks=512)
        pools = [policy["num_blocks"] for policy in tables.row_policies]
        paged = PagedCache(spec, layer_blocks(pools, tables.cell_rows), config.dtype)
        attention = RankAttention(Model(config), paged, tables.cell_rows, rank_heads(config.num_kv_heads, tp, rank))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    seq, held = -1, {}
    with tables:
        while True:
            message = conn.recv()
            if message[0] == "stop":
                return
            _, layer, step_seq, plain, q, kv = message
            try:
                if step_seq != seq:  # a new step: its deltas first, then the tables as they are now
                    tables.wait_for(step_seq, timeout=10)
                    seq, held = step_seq, {}
                items = []
                for rid, positions, stop in plain:
                    if rid not in held:
                        held[rid] = np.array(tables.table(rid))
                    items.append(Item(rid, positions, stop, held[rid]))
                out = attention(layer, paddle.to_tensor(q), tuple(paddle.to_tensor(x) for x in kv), items)
                conn.send(("out", out.numpy()))
            except Exception as exc:
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
