"""Tensor parallelism for the reference engine: each rank's KV cache and attention in a process of its own.

The scheduler and the dense parts of the model stay in the engine's process;
per layer, each rank gets the query heads and the K and V of the kv heads it
owns (``rank_heads``), stores them in its own cache through the tables its
own ``TableSubscriber`` follows (the rank's rows: its kv heads' rows, each
layer group's), attends, and sends its heads' output back. So every rank
proves that the daemon's deltas give it exactly its rows. A rank's cache is a
``PagedCache`` (Paddle, CPU), or with a PyTorch model its kv heads' cache on
the model's device, read by flex attention (``gpu.FlexAttention``).
"""
from __future__ import annotations

import multiprocessing as mp
import time
import uuid
from typing import Any

import numpy as np

from kvcache.transfer.heads import rank_heads

from backend import paddle_backend
from attention import Item, RankAttention
from model import Model, ModelConfig
from paged_cache import PagedCache, cache_spec, layer_blocks


class TPAttention:
    """``attention(layer, q, kv, items)`` over ``tp`` worker processes, each following the daemon at
    ``endpoint`` as TP rank r (its scheduler is ``client``: the workers wait for its last seq)."""

    def __init__(self, config: ModelConfig, endpoint: str, client: Any, tp: int, *, block_size: int,
                 head_wise: bool = False, quant: str = "none", timeout: float = 60.0, prefill: bool = False,
                 ops: Any = None, max_batch: int = 16, max_tokens: int = 64) -> None:
        """``prefill``: the daemon is a PD prefill node; each rank then sends its heads' KV to the decode node,
        layer by layer, through a messager of its own (``begin_step`` tells them a step's requests). ``ops``: the
        model's backend (default Paddle's); a PyTorch one puts each rank's cache on a GPU of its own where there
        are enough (``rank_devices``), read by flex attention for steps of at most ``max_batch`` requests and
        ``max_tokens`` queries each."""
        if config.kv_lora_rank or config.num_kv_heads % tp:
            raise ValueError(f"tp: {tp} ranks need kv heads they divide (GQA), got {config.num_kv_heads}")
        self.ops = ops if ops is not None else paddle_backend()
        devices = self.devices = rank_devices(self.ops, tp)
        self.client, self.timeout = client, timeout
        self.heads = [rank_heads(config.num_kv_heads, tp, r) for r in range(tp)]
        self.q_per_kv = config.num_q_heads // config.num_kv_heads
        ctx = mp.get_context("spawn")
        self.conns, self.processes = [], []
        for rank in range(tp):
            conn, child = ctx.Pipe()
            process = ctx.Process(target=_rank, daemon=True,
                                  args=(child, config, endpoint, rank, tp, block_size, head_wise, quant, prefill,
                                        devices[rank], max_batch, max_tokens))
            process.start()
            self.conns.append(conn)
            self.processes.append(process)
        for rank in range(tp):
            self._receive(rank, 120.0)

    def __call__(self, layer: int, q: Any, kv: tuple[Any, ...], items: list[Item]) -> Any:
        seq = self.client.last_seq
        plain = [(item.rid, item.positions, item.stop) for item in items]
        ops = self.ops
        q_np, kv_np = ops.numpy(q), [ops.numpy(x) for x in kv]
        for conn, heads in zip(self.conns, self.heads):
            qs = q_np[:, heads.start * self.q_per_kv:heads.stop * self.q_per_kv]
            conn.send(("attend", layer, seq, plain, qs, [x[:, heads.start:heads.stop] for x in kv_np]))
        outs = [self._receive(rank, self.timeout) for rank in range(len(self.conns))]
        out = ops.tensor(np.concatenate(outs, axis=1))
        return out if ops.name != "torch" else out.to(q.dtype)

    def begin_step(self, chunks: list[Any], plans: dict[Any, Any]) -> None:
        """A PD prefill step is about to run: every rank's messager learns its requests (and their plans)."""
        for conn in self.conns:
            conn.send(("step", chunks, plans))
        for rank in range(len(self.conns)):
            self._receive(rank, self.timeout)

    def inspect(self, rids: list[Any], step: bool) -> list[tuple[range, np.ndarray, list[Any], list[Any]]]:
        """For the proof (``check.CacheProof``): per rank, its kv heads, its ``head_rows``, the tables of ``rids``
        (with ``step`` those its last step read, else its subscriber's now) and its cache arrays by layer."""
        for conn in self.conns:
            conn.send(("inspect", self.client.last_seq, rids, step))
        return [(heads, *self._receive(rank, self.timeout)) for rank, heads in enumerate(self.heads)]

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


def rank_devices(ops: Any, tp: int) -> list[str | None]:
    """Each TP rank's device: with PyTorch on a GPU, rank r on the r-th GPU from the model's (one GPU per rank
    while there are enough, then around again), as TP runs; None (Paddle's caches on the CPU) otherwise."""
    if ops.name != "torch":
        return [None] * tp
    device = ops.torch.device(str(ops.device))
    if device.type != "cuda":
        return [str(device)] * tp
    count = ops.torch.cuda.device_count()
    return [f"cuda:{((device.index or 0) + r) % count}" for r in range(tp)]


def _rank(conn: Any, config: ModelConfig, endpoint: str, rank: int, tp: int, block_size: int, head_wise: bool,
          quant: str, prefill: bool, device: str | None = None, max_batch: int = 16, max_tokens: int = 64) -> None:
    """A TP rank: its subscriber, its cache (on ``device`` with PyTorch, else Paddle's on the CPU), its attention
    (and on a PD prefill node its messager); answers one message at a time until told to stop."""
    from kvcache.ops import send_cache
    from kvcache.pd.links import PrefillLink
    from kvcache.transfer import KVRegion, LayerSignal
    from kvcache.client import CacheClient
    from kvcache.tier_agent import TierAgent
    from kvcache.worker import TableSubscriber

    link = signal = agent = None
    try:
        spec = cache_spec(config, block_size=block_size, head_wise=head_wise, quant=quant, tp_size=tp)
        tables = TableSubscriber(endpoint, rank=rank, tp_size=tp, max_slots=64, max_blocks=512)
        pool_blocks, head_rows = [policy["num_blocks"] for policy in tables.row_policies], tables.cell_rows
        heads = rank_heads(config.num_kv_heads, tp, rank)
        if device is None:
            ops = paddle_backend()
            paged = PagedCache(spec, layer_blocks(pool_blocks, head_rows), config.dtype)
            attention = RankAttention(Model(config), paged, head_rows, heads)
            views = paged.views
        else:
            from backend import TorchBackend
            from gpu import FlexAttention

            ops = TorchBackend(device)
            attention = FlexAttention(Model(config, ops), spec, layer_blocks(pool_blocks, head_rows), head_rows,
                                      max_batch=max_batch, max_tokens=max_tokens, heads=heads)
            views = attention.views
        stream = ops.write_stream()
        region = KVRegion.from_tensors(spec, [views(layer) for layer in range(spec.num_layers)])
        if prefill:
            signal = LayerSignal.create(f"kvcache-engine-{uuid.uuid4().hex[:12]}-r{rank}", spec.num_layers)
            link = PrefillLink(endpoint, region, signal, rank)
        with CacheClient(endpoint, timeout=10) as client:
            if client.info().get("host_tier"):  # the daemon's host tier: this rank copies its heads' part
                agent = TierAgent(tables, region)
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    try:
        _serve_rank(conn, tables, attention, ops, link, signal, lambda layer: send_cache(stream, signal, layer), agent,
                    views)
    finally:
        if agent is not None:
            agent.close()
        if link is not None:
            link.close()
        if signal is not None:
            signal.close()
            LayerSignal.remove(signal.name)
        tables.close()


def _serve_rank(conn: Any, tables: Any, attention: Any, ops: Any, link: Any, signal: Any, layer_written: Any,
                agent: Any, views: Any) -> None:
    """A rank's loop: a PD step's requests for its messager, or one layer's attention, until told to stop.
    With the daemon's host tier, each layer waits for the rank's copies ordered so far (``agent``)."""
    seq, held = -1, {}
    while True:
        message = conn.recv()
        if message[0] == "stop":
            return
        try:
            if message[0] == "inspect":  # the proof reads the rank's tables and cache
                _, inspect_seq, rids, step = message
                tables.wait_for(inspect_seq, timeout=10)
                read = [held[rid] if step else np.array(tables.table(rid)) for rid in rids]
                arrays = [{name: ops.numpy(x) for name, x in views(layer).items()}
                          for layer in range(len(tables.cell_rows))]
                conn.send(("ok", (np.asarray(tables.cell_rows), read, arrays)))
                continue
            if message[0] == "step":
                link.run_step(signal.begin_step(), message[1], message[2])
                conn.send(("ok", None))
                continue
            _, layer, step_seq, plain, q, kv = message
            if step_seq != seq:  # a new step: its deltas first, then the tables as they are now
                tables.wait_for(step_seq, timeout=10)
                seq, held = step_seq, {}
            items = []
            for rid, positions, stop in plain:
                if rid not in held:
                    held[rid] = np.array(tables.table(rid))
                items.append(Item(rid, positions, stop, held[rid], agent))
            out = attention(layer, ops.tensor(q), tuple(ops.tensor(x) for x in kv), items)
            if signal is not None:  # the layer's K and V are written: the messager may send them
                layer_written(layer)
            conn.send(("out", ops.numpy(out)))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
