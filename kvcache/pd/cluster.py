"""A PD pair on one machine: two daemons and fake-model worker processes, for the demo, the tests and `kvcache bench pd`.

``Cluster`` starts `kvcache serve --role prefill` and `--role decode`, one worker process per
prefill rank (its cache, a LayerSignal, a CacheMessager through ``PrefillLink``) and per decode
rank (its cache, a CacheReceiver through ``DecodeLink``). A prefill worker is a fake model: per
layer it writes deterministic KV (a function of token id, position, layer, head and element, so
prefix hits on either node give identical bytes) into the blocks it did not have cached, then
calls ``send_cache``. ``run_batch`` drives one batch through a ``PDProxy`` and checks every
request's decode KV against the prefill node's and against the formula. Caches are numpy on the
CPU, PyTorch on ``cuda:N``, a device per role and per rank (``prefill_device="cuda:0"``,
``decode_device="cuda:1"``: each cache on its own GPU, NIXL moving GPU memory to GPU memory); each rank's
cache is one buffer, so one NIXL descriptor can span it. With ``hosts`` (``kvcache.pd.hosts.Hosts``) each
node runs in a network namespace of its own, its daemon on TCP at the node's address, UCX on TCP and no
kernel copy: the path between two nodes.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np

from kvcache.allocator.errors import KVCacheError
from kvcache.allocator import CacheSpec
from kvcache.allocator.layout import DTYPE_BYTES
from kvcache.allocator.rows import table_cells
from kvcache.launch import launch_serve, wait_ready
from kvcache.transfer.heads import rank_heads

RAW = {1: np.uint8, 2: np.uint16, 4: np.uint32}
PEER_ACCESS_ALREADY_ENABLED = 704  # cudaErrorPeerAccessAlreadyEnabled
CROSS_HOST_PORT = 5600  # each node's daemon, at its own address (its PUB and replay on the next ports)


# --------------------------------------------------------------------------- the fake model


class StepTimes(NamedTuple):
    """When a prefill step signalled its first and its last layer (CLOCK_MONOTONIC ns)."""

    first_ns: int
    last_ns: int


def signal_of(cfg: dict[str, Any], rank: int) -> str:
    """The shared-memory name of prefill rank ``rank``'s layer signal (the cluster removes it even if the worker was killed)."""
    return f"{cfg['signal_prefix']}-r{rank}"


def shared_cache_of(cfg: dict[str, Any], role: str, rank: int) -> str:
    """The /dev/shm name of a rank's shared CPU cache (removed once its link process mapped it, or by the cluster)."""
    return f"{cfg['signal_prefix']}-cache-{role}-r{rank}"


def role_devices(value: str, tp: int, field: str) -> list[str]:
    """Each rank's device from ``value``: one device for every rank (``cuda:1``) or one per rank, comma-separated
    (``cuda:0,cuda:1``); ``cuda`` is ``cuda:0``. A KVCacheError names ``field`` otherwise."""
    devices = ["cuda:0" if d.strip() == "cuda" else d.strip() for d in value.split(",")]
    for device in devices:
        kind, _, index = device.partition(":")
        if device != "cpu" and not (kind == "cuda" and index.isdigit()):
            raise KVCacheError(f"{field}: {device!r} is not cpu, cuda or cuda:N")
    if len(devices) not in (1, tp):
        raise KVCacheError(f"{field}: {len(devices)} devices for {tp} ranks; give one, or one per rank")
    return devices * tp if len(devices) == 1 else devices


def enter_node(cfg: dict[str, Any], role: str, device: str) -> None:
    """A worker's first step: into its node's network namespace and environment (with ``hosts``), onto its GPU."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL prints INFO lines on stdout, where `bench pd --json` writes
    node = cfg["nodes"].get(role)
    if node:
        from kvcache.pd.hosts import enter_netns

        enter_netns(node["netns"])
        os.environ.update(node["env"])
    if device.startswith("cuda"):
        import torch

        torch.cuda.set_device(torch.device(device))  # streams, NIXL's and UCX's CUDA calls: on this rank's GPU


def spec_of(cfg: dict[str, Any], tp: int) -> CacheSpec:
    """A rank's spec: from the model config the daemons serve (its rows: layer groups), else the cluster's geometry."""
    if cfg.get("model"):
        return CacheSpec.from_hf_config(cfg["model"], block_size=cfg["block_size"], dtype="bfloat16", tp_size=tp,
                                        head_wise=cfg.get("head_wise", False))
    return CacheSpec(num_layers=cfg["layers"], num_kv_heads=cfg["kv_heads"], head_dim=cfg["head_dim"],
                     block_size=cfg["block_size"], dtype="bfloat16", tp_size=tp)


def cells_of(spec: CacheSpec, table: np.ndarray) -> np.ndarray:
    """[layers, kv heads]: the row of ``table`` (``[rows, n]``) each layer's head reads (``table_cells``)."""
    return table_cells(spec.rows, table.shape[0], spec.num_layers, spec.num_kv_heads)


def kv_values(tokens: np.ndarray, blocks: range, layer: int, heads: range, tensor: int, shape: tuple[int, ...],
              dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    """The model's KV of ``blocks`` (logical indices) for ``heads``: [n, heads, block_size, dim], and which slots hold tokens."""
    bs, dim = shape[1], shape[2]
    pos = (np.arange(blocks.start, blocks.stop, dtype=np.int64)[:, None] * bs + np.arange(bs)[None, :])
    valid = pos < tokens.size
    tok = np.where(valid, tokens[np.minimum(pos, tokens.size - 1)].astype(np.int64), 0)
    g = np.arange(heads.start, heads.stop, dtype=np.int64)
    j = np.arange(dim, dtype=np.int64)
    value = (tok[:, None, :, None] * 2654435761 + pos[:, None, :, None] * 40503 + layer * 97
             + g[None, :, None, None] * 7919 + tensor * 104729 + j[None, None, None, :] * 31)
    value ^= value >> 13
    bits = 8 * np.dtype(dtype).itemsize
    return (value & ((1 << bits) - 1)).astype(dtype), valid


class Cache:
    """One rank's paged cache: per layer, per tensor, a view ``[num_blocks, heads, block_size, dim]`` of one buffer."""

    def __init__(self, spec: CacheSpec, num_blocks: int | list[int], device: str, shared: str = "") -> None:
        """``num_blocks``: every layer's blocks, or one count per layer (layer groups with pools of their own).
        ``shared``: a CPU cache in a SharedHostBuffer of that name, which a link in its own process can map."""
        from kvcache.transfer.regions import buffer_bytes

        self.spec, self.device = spec, device
        self.torch: Any = None
        self._stream: Any = None
        self.host: Any = None
        counts = [num_blocks] * spec.num_layers if isinstance(num_blocks, int) else list(num_blocks)
        nbytes = buffer_bytes(spec, counts)
        if device == "cpu":
            if shared:
                from kvcache.transfer.sharing import SharedHostBuffer

                self.host = SharedHostBuffer(nbytes, name=shared)
                self.buffer = self.host.array
            else:
                self.buffer = np.zeros(nbytes, np.uint8)
            view = lambda lo, hi, dtype, shape: self.buffer[lo:hi].view(dtype).reshape(shape)  # noqa: E731
        else:
            import torch

            self.torch = torch
            self.buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
            kinds = {np.uint8: torch.int8, np.uint16: torch.int16, np.uint32: torch.int32}
            view = lambda lo, hi, dtype, shape: self.buffer[lo:hi].view(kinds[dtype]).view(shape)  # noqa: E731
        self.layers, offset = [], 0
        for count in counts:
            row = []
            for t in spec.tensors():
                n = t.nbytes(count)
                row.append(view(offset, offset + n, RAW[DTYPE_BYTES[t.dtype]], t.shape(count)))
                offset += n
            self.layers.append(row)

    def unshare(self) -> None:
        """Remove a shared cache's file once the link process mapped it: nothing is left behind if the worker dies."""
        if self.host is not None:
            self.host.close()

    @contextlib.contextmanager
    def computing(self) -> Iterator[Any]:
        """A step's compute stream (None on the CPU): a stream of its own, as an engine's model runs on, made current;
        synchronised on the way out. Not the legacy default stream, which would order the transfers' copies behind
        every kernel."""
        if self.torch is None:
            yield None
            return
        if self._stream is None:
            self._stream = self.torch.cuda.Stream(device=self.buffer.device)
        with self.torch.cuda.stream(self._stream):
            yield self._stream
        self._stream.synchronize()

    def write(self, layer: int, ids: np.ndarray, values: np.ndarray, valid: np.ndarray, heads: slice = slice(None)
              ) -> None:
        """Put ``values`` in ``heads`` of blocks ``ids`` of every tensor's slots that hold tokens (others keep their bytes)."""
        for t, (arr, vals) in enumerate(zip(self.layers[layer], values)):
            if self.torch is None:
                old = arr[ids, heads]
                arr[ids, heads] = np.where(valid[:, None, :, None], vals, old)
            else:
                torch = self.torch
                index = torch.from_numpy(ids).to(arr.device)
                new = torch.from_numpy(vals.view(np.dtype(f"i{vals.itemsize}"))).to(arr.device, non_blocking=True)
                mask = torch.from_numpy(valid[:, None, :, None]).to(arr.device)
                arr[index, heads] = torch.where(mask, new, arr[index, heads])

    def read(self, ids: np.ndarray) -> list[list[np.ndarray]]:
        """Blocks ``ids`` of every layer and tensor, as numpy (raw unsigned views); zeros past a layer's blocks."""
        out = []
        for row in self.layers:
            have = ids < row[0].shape[0]
            if self.torch is None:
                parts = [arr[ids[have]] for arr in row]
            else:
                index = self.torch.from_numpy(ids[have]).to(row[0].device)
                parts = [arr[index].cpu().numpy().view(RAW[arr.element_size()]) for arr in row]
            whole = []
            for part in parts:
                full = np.zeros((ids.size, *part.shape[1:]), part.dtype)
                full[have] = part
                whole.append(full)
            out.append(whole)
        return out


def gather(parts: list[list[list[np.ndarray]]], num_kv_heads: int) -> list[np.ndarray]:
    """Per-rank reads (``[rank][layer][tensor]`` of ``[n, heads, ...]``) as one global array per (layer, tensor), flattened."""
    tp = len(parts)
    out = []
    for layer in range(len(parts[0])):
        for t in range(len(parts[0][layer])):
            shape = parts[0][layer][t].shape
            whole = np.zeros((shape[0], num_kv_heads, *shape[2:]), parts[0][layer][t].dtype)
            for r in reversed(range(tp)):  # the lowest rank holding a replicated head wins
                whole[:, list(rank_heads(num_kv_heads, tp, r))] = parts[r][layer][t]
            out.append(whole)
    return out


# --------------------------------------------------------------------------- worker processes


def prefill_worker(conn: Any, cfg: dict[str, Any], rank: int) -> None:
    """A prefill rank: cache, layer signal, messager; runs steps of the fake model on command."""
    from kvcache.pd.process import MessagerProcess
    from kvcache.pd.links import PrefillLink
    from kvcache.transfer import KVRegion, LayerSignal
    from kvcache.pd.messager import Chunk

    device = cfg["devices"]["prefill"][rank]
    enter_node(cfg, "prefill", device)
    spec = spec_of(cfg, cfg["prefill_tp"])
    process = cfg["link"] == "process"
    shared = shared_cache_of(cfg, "prefill", rank) if process else ""
    cache = Cache(spec, cfg["layer_blocks"]["prefill"], device, shared=shared)
    region = KVRegion.from_tensors(spec, cache.layers)
    sig = LayerSignal.create(signal_of(cfg, rank), spec.num_layers, replace=True)
    heads = rank_heads(spec.num_kv_heads, spec.tp_size, rank)
    make_link = MessagerProcess if process else PrefillLink
    with contextlib.ExitStack() as stack:
        stack.enter_context(sig)
        try:
            link = stack.enter_context(make_link(cfg["prefill"], region, sig, rank, timeout=cfg["timeout"],
                                                 progress=cfg["progress"]))
        finally:
            cache.unshare()
        run = link.call if process else functools.partial(in_link, link, region)

        def steps(payload: Any) -> list[StepTimes]:
            # per step: items, plans. items: (req, tokens, table, first token to compute[, stop token, last
            # chunk]); the table is a uniform one's row, or a head-wise table [kv heads, blocks]; without a stop,
            # the step computes the rest of the prompt (every block of the table). plans: by request, the plans
            # their prefill admits returned (the others' the messager fetches).
            # behind: the messager hears of every step only once all of them are computed (a messager that fell
            # behind the writer by whole steps)
            batches, layer_delay, compute, behind, spin = payload
            times, queued = [], []
            for items, plans in batches:
                items = [(*item, item[2].shape[-1] * spec.block_size, True) if len(item) == 4 else item
                         for item in items]
                step = (sig.begin_step(), [Chunk(req, stop, last) for req, _, _, _, stop, last in items], plans)
                if behind:
                    queued.append(step)
                else:
                    link.run_step(*step)
                with cache.computing() as stream:
                    run_layers(cache, spec, sig, heads, items, layer_delay, compute, stream, spin)
                done = sig.layer_times().done_ns
                times.append(StepTimes(int(done[0]), int(done[spec.num_layers - 1])))
            for number, chunks, plans in queued:
                link.run_step(number, chunks, plans)
            return times

        conn.send(("ready", None))
        answer_commands(conn, {
            "read": lambda ids: cache.read(np.asarray(ids, dtype=np.int64)),
            "posted": lambda req: run(posted_bytes, req),
            "sent_ns": lambda req: run(sent_times, req),
            "probe": lambda args: run(probe, *args),
            "link_pid": lambda _: link.process.pid if process else os.getpid(),
            "peer_copy": lambda args: peer_copy(cache, *args),
            "kernel_copy": lambda _: run(kernel_copy_on),
            "device": lambda _: str(cache.buffer.device) if cache.torch is not None else "cpu",
            "steps": steps,
        })


def in_link(link: Any, region: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(link, region, *args)`` where the link runs in the worker's own process (``link.call`` does it in a link process)."""
    return fn(link, region, *args)


def posted_bytes(link: Any, region: Any, req: Any) -> int:
    return link.messager.posted_bytes.get(req, 0)


def sent_times(link: Any, region: Any, req: Any) -> dict[str, int]:
    return link.messager.sent_ns.get(req, {})


def kernel_copy_on(link: Any, region: Any) -> bool:
    return link.engine.kernel_copy


def received_times(link: Any, region: Any) -> dict[Any, int]:
    return dict(link.receiver.received_ns)


def answer_commands(conn: Any, answers: dict[str, Callable[[Any], Any]]) -> None:
    """A worker process's loop: ``(command, payload)`` in, ``(command, answers[command](payload))`` out, until stop."""
    while True:
        command, payload = conn.recv()
        if command == "stop":
            return
        conn.send((command, answers[command](payload)))


def run_layers(cache: Cache, spec: CacheSpec, sig: Any, heads: range, items: list, layer_delay: float, compute: bool,
               stream: Any, spin: bool = False) -> None:
    """The fake model's layers for one step: each writes its KV (unless ``compute`` is off), then ``send_cache``.

    ``layer_delay`` is spent asleep (the GIL free, as a runner waiting on its GPU) or, with ``spin``,
    running Python (the GIL held, as a runner launching kernels)."""
    from kvcache.ops import send_cache

    tables = [np.atleast_2d(table) for _, _, table, *_ in items]
    cells = [cells_of(spec, table) for table in tables]
    for layer in range(spec.num_layers):
        for (_, tokens, _, start, stop, _), table, cell in zip(items, tables, cells):
            first = start // spec.block_size
            blocks = range(first, min(table.shape[-1], -(-stop // spec.block_size)))
            if blocks and compute:
                values = [kv_values(tokens[:stop], blocks, layer, heads, t, ts.block_shape,
                                    RAW[DTYPE_BYTES[ts.dtype]]) for t, ts in enumerate(spec.tensors())]
                rows = cell[layer, heads.start:heads.stop]
                if (rows == rows[0]).all():  # one row holds every head of the rank in this layer: whole blocks
                    ids = table[rows[0], blocks.start:blocks.stop].astype(np.int64)
                    held = ids >= 0
                    cache.write(layer, ids[held], [v[held] for v, _ in values], values[0][1][held])
                    continue
                for k, row in enumerate(rows.tolist()):  # each head's blocks come from its own row
                    ids = table[row, blocks.start:blocks.stop].astype(np.int64)
                    held = ids >= 0
                    cache.write(layer, ids[held], [v[held, k:k + 1] for v, _ in values], values[0][1][held],
                                slice(k, k + 1))
        send_cache(stream, sig, layer)
        if layer_delay and spin:
            end = time.perf_counter() + layer_delay
            while time.perf_counter() < end:
                pass
        elif layer_delay:
            time.sleep(layer_delay)


def probe(link: Any, region: Any, src: np.ndarray, dst: np.ndarray, receivers: tuple[str, ...], repeat: int,
          batch: int = 1) -> dict[str, Any]:
    """Limits measured on the messager's own path: one layer's write alone, and all its bytes as one descriptor.

    Each a write posted and waited for, into decode rank 0's region, 2 x ``repeat`` times: one
    layer's median and best (the layers in turn), the one-descriptor write's best, and the best of one descriptor of
    ``batch`` times the request's bytes. Also every layer's ranges as one write (best), and how
    long each kind's transfer() call took (median): with the raw write, they split the pipeline's
    cost into per transfer, per range and per byte.
    """
    from kvcache.pd.messager import TransferPlan
    from kvcache.transfer.regions import CopyRanges

    messager = link.messager
    plan = TransferPlan("probe", np.atleast_2d(src), np.atleast_2d(dst), 0, tuple(receivers), time.monotonic() + 60)
    (d, (remote, agent)), *_ = messager._targets(plan).items()
    # One layer alone: each write a different layer, in turn, as the pipeline moves them; the same layer
    # again and again would move bytes the previous write left in the CPU's caches, which no layer of the
    # pipeline finds there.
    layers = [messager._ranges(plan, d, remote, [n]) for n in range(region.num_layers)]
    layer = layers[0]
    every = messager._ranges(plan, d, remote, list(range(region.num_layers)))
    total = every.nbytes
    lo, hi = region.extents(), remote.extents()
    assert lo.length[0] >= batch * total and hi.length[0] >= batch * total, "caches are not one buffer each"
    one = CopyRanges(lo.addr[:1], hi.addr[:1], np.array([total], dtype=np.int64))
    many = CopyRanges(lo.addr[:1], hi.addr[:1], np.array([batch * total], dtype=np.int64))

    kinds = (("layer", layers), ("every", [every]), ("raw", [one]), ("raw_batch", [many]))
    times: dict[str, list[float]] = {name: [] for name, _ in kinds}
    posts: dict[str, list[float]] = {name: [] for name, _ in kinds}
    turn = itertools.count()
    for _ in range(2):  # alternate, so all see the same machine
        for name, choices in kinds:
            for _ in range(repeat):
                ranges = choices[next(turn) % len(choices)]
                start = time.monotonic_ns()
                handle = link.engine.submit(ranges, agent, region, remote, deadline=time.monotonic() + 60)
                status = handle.wait()
                times[name].append((time.monotonic_ns() - start) / 1e9)
                posts[name].append((handle.posted_ns - handle.picked_ns) / 1e9)
                assert status.value == "done", handle.error
    return {"layer_s": float(np.median(times["layer"])), "layer_best_s": min(times["layer"]),
            "layer_bytes": layer.nbytes, "layer_ranges": layer.num_ranges, "raw_s": min(times["raw"]), "raw_bytes": total,
            "every_s": min(times["every"]), "every_ranges": every.num_ranges, "raw_batch_s": min(times["raw_batch"]),
            "post_s": {name: float(np.median(v)) for name, v in posts.items() if name != "raw_batch"}}


def peer_copy(cache: Cache, device: str, nbytes: int, repeat: int) -> dict[str, Any]:
    """The hardware's limit between this rank's GPU and ``device``: ``cudaMemcpyPeer`` of ``nbytes`` of the cache into a
    buffer there (best of ``repeat``, peer access enabled where the GPUs have it), and whether they have it."""
    import ctypes

    from kvcache.transfer.engines import CudaRuntime

    torch, rt = cache.torch, CudaRuntime()
    src, dst = cache.buffer.device.index, torch.device(device).index
    can = ctypes.c_int()
    rt.check(rt.lib.cudaDeviceCanAccessPeer(ctypes.byref(can), src, dst), "cudaDeviceCanAccessPeer")
    if can.value:
        with torch.cuda.device(src):
            code = rt.lib.cudaDeviceEnablePeerAccess(dst, 0)
            if code != PEER_ACCESS_ALREADY_ENABLED:
                rt.check(code, "cudaDeviceEnablePeerAccess")
            rt.lib.cudaGetLastError()  # "already enabled" is no error here
    assert cache.buffer.numel() >= nbytes, (cache.buffer.numel(), nbytes)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize(src)
        torch.cuda.synchronize(dst)
        start = time.perf_counter()
        rt.check(rt.lib.cudaMemcpyPeer(target.data_ptr(), dst, cache.buffer.data_ptr(), src, nbytes), "cudaMemcpyPeer")
        torch.cuda.synchronize(dst)
        torch.cuda.synchronize(src)
        times.append(time.perf_counter() - start)
    del target
    torch.cuda.empty_cache()
    return {"peer_s": min(times), "p2p": bool(can.value)}


def decode_worker(conn: Any, cfg: dict[str, Any], rank: int) -> None:
    """A decode rank: cache and receiver; reads blocks back on command."""
    from kvcache.pd.process import ReceiverProcess
    from kvcache.pd.links import DecodeLink
    from kvcache.transfer import KVRegion

    device = cfg["devices"]["decode"][rank]
    enter_node(cfg, "decode", device)
    spec = spec_of(cfg, cfg["decode_tp"])
    process = cfg["link"] == "process" and device == "cpu"  # a GPU cache's receiver stays: see ReceiverProcess
    shared = shared_cache_of(cfg, "decode", rank) if process else ""
    cache = Cache(spec, cfg["layer_blocks"]["decode"], device, shared=shared)
    region = KVRegion.from_tensors(spec, cache.layers)
    make_link = ReceiverProcess if process else DecodeLink
    node = cfg["nodes"].get("decode")
    listen = f"tcp://{node['address']}:*" if node else "tcp://127.0.0.1:*"  # where the prefill node reaches it
    try:
        link = make_link(cfg["decode"], region, rank, listen=listen, timeout=cfg["timeout"], progress=cfg["progress"])
    finally:
        cache.unshare()
    run = link.call if process else functools.partial(in_link, link, region)
    with link:
        conn.send(("ready", link.listen_endpoint if process else link.receiver.endpoint))
        answer_commands(conn, {
            "read": lambda ids: cache.read(np.asarray(ids, dtype=np.int64)),
            "received_ns": lambda _: run(received_times),
            "kernel_copy": lambda _: run(kernel_copy_on),
            "device": lambda _: str(cache.buffer.device) if cache.torch is not None else "cpu",
            "link_pid": lambda _: link.process.pid if process else os.getpid(),
        })


class Worker:
    """A worker process and the pipe that drives it; every call has a deadline."""

    def __init__(self, target: Any, cfg: dict[str, Any], rank: int, start_timeout: float = 120.0) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        # A link in its own process is this worker's child, and a daemonic process may have none.
        self.process = ctx.Process(target=target, args=(child, cfg, rank), daemon=cfg["link"] != "process")
        self.process.start()
        self.info = self._reply("ready", start_timeout)

    def call(self, command: str, payload: Any = None, timeout: float = 60.0) -> Any:
        self.conn.send((command, payload))
        return self._reply(None, timeout)

    def send(self, command: str, payload: Any = None) -> None:
        self.conn.send((command, payload))

    def _reply(self, expect: str | None, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.1):
            if not self.process.is_alive():
                raise RuntimeError(f"worker pid {self.process.pid} exited with {self.process.exitcode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker pid {self.process.pid} did not answer within {timeout:g} s")
        kind, value = self.conn.recv()
        assert expect is None or kind == expect, f"worker answered {kind!r}, expected {expect!r}"
        return value

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(("stop", None))
            except (BrokenPipeError, OSError):
                pass
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


# --------------------------------------------------------------------------- the cluster


class Cluster:
    """Two daemons and their workers; ``close`` stops everything it started, also after errors."""

    def __init__(self, *, layers: int = 4, kv_heads: int = 4, head_dim: int = 32, block_size: int = 16,
                 num_blocks: int = 512, prefill_tp: int = 1, decode_tp: int = 1, device: str = "cpu",
                 prefill_device: str = "", decode_device: str = "", hosts: Any = None,
                 timeout: float = 20.0, rows: str = "full", progress: str = "thread", link: str = "thread",
                 model: dict[str, Any] | None = None, head_wise: bool = False, memory: str = "",
                 max_model_len: int = 0, max_num_batched_tokens: int = 0) -> None:
        """``rows``: both daemons' ``--rows`` (``full``: uniform tables; one policy per kv head: head-wise);
        ``progress``: the NIXL engines' progress mode (``thread`` or ``poll``, see NixlEngine); ``link``:
        ``thread`` runs each rank's messager or receiver in the worker's process, ``process`` in a process of
        its own (``MessagerProcess``, and ``ReceiverProcess`` for CPU caches; those then live in shared memory).
        ``model``: a config.json's fields the daemons serve (``--model``; its rows, such as layer groups, replace
        ``rows`` and the geometry), per kv head within each group with ``head_wise``; with ``memory`` and
        ``max_model_len`` (and ``max_num_batched_tokens``) each row's pool is sized from that much memory per rank
        (``--gpu-memory``, ``--max-model-len``) instead of ``num_blocks`` blocks each. ``prefill_device`` and
        ``decode_device`` (default ``device``) place each role's caches: one device, or one per rank
        (``cuda:0,cuda:1``). ``hosts``: a ``kvcache.pd.hosts.Hosts`` whose nodes run the two roles (each daemon
        on TCP at its node's address, each worker in its node's namespace and environment)."""
        if link not in ("thread", "process"):
            raise KVCacheError(f"link: must be 'thread' or 'process', got {link!r}")
        if memory and not model:
            raise KVCacheError("memory: sizes the pools of a model's rows; give model too")
        devices = {"prefill": role_devices(prefill_device or device, prefill_tp, "prefill_device"),
                   "decode": role_devices(decode_device or device, decode_tp, "decode_device")}
        gpus = {int(d.partition(":")[2]) for ds in devices.values() for d in ds if d != "cpu"}
        if gpus:
            try:
                import torch
            except ImportError:
                raise KVCacheError(f"device: cuda:{max(gpus)} needs PyTorch with CUDA (pip install torch)") from None
            have = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if max(gpus) >= have:
                raise KVCacheError(f"device: cuda:{max(gpus)}: PyTorch sees {have} CUDA devices") from None
        self.hosts = hosts
        nodes = {role: {"netns": node.netns, "address": node.address, "env": hosts.env(role)}
                 for role, node in hosts.nodes.items()} if hosts is not None else {}
        self.folder = Path(tempfile.mkdtemp(prefix="kv-pd-", dir="/tmp"))
        self.daemons: dict[str, subprocess.Popen] = {}
        self.prefill_workers: list[Worker] = []
        self.decode_workers: list[Worker] = []
        config = ""
        if model:
            config = str(self.folder / "config.json")
            Path(config).write_text(json.dumps(model))
        endpoints = {role: f"tcp://{nodes[role]['address']}:{CROSS_HOST_PORT}" if role in nodes
                     else f"ipc://{self.folder}/{role}.sock" for role in ("prefill", "decode")}
        self.cfg = dict(layers=layers, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
                        num_blocks=num_blocks, prefill_tp=prefill_tp, decode_tp=decode_tp, devices=devices,
                        timeout=5.0, rows=rows, progress=progress, link=link, **endpoints, nodes=nodes,
                        signal_prefix=f"kvcache-pd-{uuid.uuid4().hex[:12]}", model=config, head_wise=head_wise)
        try:
            for tp in (prefill_tp, decode_tp):  # a geometry the ranks cannot split fails here, not in a worker
                spec_of(self.cfg, tp)
            sizing = (["--gpu-memory", memory, "--utilization", "1", "--max-model-len", str(max_model_len),
                       "--max-num-batched-tokens", str(max_num_batched_tokens)] if memory
                      else ["--num-blocks", str(num_blocks)])
            for role, tp in (("prefill", prefill_tp), ("decode", decode_tp)):
                self.daemons[role] = self._serve(role, tp, sizing, block_size, timeout)
            for role, tp in (("prefill", prefill_tp), ("decode", decode_tp)):
                self._wait_ready(role)
            self.cfg["layer_blocks"] = {role: self._layer_blocks(role) for role in ("prefill", "decode")}
            self.decode_workers = [Worker(decode_worker, self.cfg, r) for r in range(decode_tp)]
            self.prefill_workers = [Worker(prefill_worker, self.cfg, r) for r in range(prefill_tp)]
        except BaseException:
            self.close()
            raise
        self.spec = spec_of(self.cfg, prefill_tp)

    def _serve(self, role: str, tp: int, sizing: list[str], block_size: int, timeout: float) -> subprocess.Popen:
        model = (["--model", self.cfg["model"], *(["--head-wise"] if self.cfg["head_wise"] else [])]
                 if self.cfg["model"] else ["--rows", self.cfg["rows"]])
        flags = ["--role", role, "--tp", str(tp), "--endpoint", self.cfg[role], *sizing,
                 "--block-size", str(block_size), "--transfer-timeout", str(timeout), *model]
        if role not in self.cfg["nodes"]:
            return launch_serve(flags, self.folder / f"{role}.log")
        with open(self.folder / f"{role}.log", "wb") as out:  # as launch_serve, inside the node's namespace
            return subprocess.Popen(self.hosts.command(role, [sys.executable, "-m", "kvcache", "serve", *flags]),
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def _layer_blocks(self, role: str) -> list[int]:
        """Each layer's blocks on ``role``'s ranks: the pool of the rows holding the layer (as the daemon says)."""
        from kvcache.client import CacheClient

        with CacheClient(self.cfg[role]) as client:
            info = client.info()
        layers = spec_of(self.cfg, 1).num_layers
        counts = [0] * layers
        for row in info["rows"]:
            for layer in row.get("layers", range(layers)):
                counts[layer] = max(counts[layer], row["num_blocks"])
        return counts

    def _wait_ready(self, role: str, timeout: float = 30.0) -> None:
        try:
            wait_ready(self.daemons[role], self.folder / f"{role}.log", timeout)
        except KVCacheError as exc:
            raise RuntimeError(f"{role} daemon did not start: {exc}") from None

    def log(self, role: str) -> str:
        return (self.folder / f"{role}.log").read_text(errors="replace")

    def kill_decode(self) -> None:
        """SIGKILL the whole decode node: its daemon and its workers."""
        for w in self.decode_workers:
            if w.process.is_alive():
                os.kill(w.process.pid, signal.SIGKILL)
        self.daemons["decode"].kill()
        self.daemons["decode"].wait(10)

    def close(self) -> None:
        for w in self.prefill_workers + self.decode_workers:
            w.stop()
        from kvcache.transfer import LayerSignal

        for rank in range(self.cfg["prefill_tp"]):
            LayerSignal.remove(signal_of(self.cfg, rank))  # a worker killed with SIGKILL leaves its record
        for role in ("prefill", "decode"):
            for rank in range(self.cfg[f"{role}_tp"]):
                with contextlib.suppress(FileNotFoundError):  # likewise a shared cache killed before its link mapped it
                    os.unlink(f"/dev/shm/{shared_cache_of(self.cfg, role, rank)}")
        for p in self.daemons.values():
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- requests

    def step(self, items: list[tuple[Any, np.ndarray, np.ndarray, int]], layer_delay: float = 0.0,
             compute: bool = True, plans: dict[Any, dict[str, Any]] | None = None, *, spin: bool = False) -> StepTimes:
        """Run one prefill step on every prefill rank; returns its earliest first and latest last layer signals.

        ``layer_delay`` seconds of "compute" follow each layer; ``compute=False`` writes no KV (benchmarks);
        ``plans`` go with the step (``Sending.plan`` by request), else the messagers fetch them.
        """
        return self.steps([(items, plans)], layer_delay, compute, spin=spin)[0]

    def steps(self, batches: list[tuple[list[tuple[Any, ...]], dict[Any, dict[str, Any]] | None]],
              layer_delay: float = 0.0, compute: bool = True, *, messager_behind: bool = False,
              spin: bool = False) -> list[StepTimes]:
        """Prefill steps back to back, each ``(items, plans)`` as for ``step``; returns each one's layer signals.

        ``messager_behind``: the messagers hear of the steps only after every one of them was computed,
        as a messager that fell whole steps behind its writer. ``spin``: each layer's ``layer_delay``
        runs Python (holding the GIL) instead of sleeping.
        """
        for w in self.prefill_workers:
            w.send("steps", (batches, layer_delay, compute, messager_behind, spin))
        per_worker = [w._reply("steps", 120.0) for w in self.prefill_workers]
        return [StepTimes(min(t.first_ns for t in ts), max(t.last_ns for t in ts)) for ts in zip(*per_worker)]

    def read(self, workers: list[Worker], table: np.ndarray) -> list[np.ndarray]:
        """The global KV (every head) of ``table``'s blocks on one node, per (layer, tensor), ``[blocks, heads, ...]``.

        ``table`` is a uniform table's row, or a table ``[rows, blocks]`` (head-wise, layer groups): head g of
        layer l, column c is read from block ``table[cells_of(...)[l, g], c]`` (zeros where that is -1).
        """
        table = np.atleast_2d(np.asarray(table, dtype=np.int64))
        cells = cells_of(self.spec, table)
        ids = np.unique(table[table >= 0])
        whole = gather([w.call("read", ids) for w in workers], self.spec.num_kv_heads)  # [ids, heads, ...]
        heads = np.arange(self.spec.num_kv_heads)[:, None]
        out = []
        for i, arr in enumerate(whole):
            layer_table = table[cells[i // len(self.spec.tensors())]]  # [heads, blocks]
            where = np.searchsorted(ids, np.maximum(layer_table, 0))
            picked = (arr[where, heads] if ids.size else
                      np.zeros((*layer_table.shape, *arr.shape[2:]), arr.dtype))
            picked[layer_table < 0] = 0
            out.append(np.swapaxes(picked, 0, 1))  # [blocks, heads, ...]
        return out

    def expected(self, tokens: np.ndarray, num_blocks: int) -> tuple[list[np.ndarray], np.ndarray]:
        """The formula's KV of every head for the request's blocks, per (layer, tensor), and the valid slots."""
        out, valid = [], None
        heads = range(self.spec.num_kv_heads)
        for layer in range(self.spec.num_layers):
            for t, ts in enumerate(self.spec.tensors()):
                values, valid = kv_values(tokens, range(num_blocks), layer, heads, t, ts.block_shape,
                                          RAW[DTYPE_BYTES[ts.dtype]])
                out.append(values)
        return out, valid


def wait_outcomes(client: Any, reqs: set[Any], timeout: float, interval: float = 0.001
                  ) -> tuple[dict[Any, int], dict[Any, str]]:
    """Poll ``client`` every ``interval`` seconds until every request in ``reqs`` is done or failed, or ``timeout`` passes.

    The daemon stamps each outcome when it happens, so a longer interval delays only the answer,
    not the times it reports (benchmarks poll slowly so as not to compete with what they measure).
    """
    done: dict[Any, int] = {}
    failed: dict[Any, str] = {}
    deadline = time.monotonic() + timeout
    while set(done) | set(failed) < reqs and time.monotonic() < deadline:
        outcome = client.pd_poll()
        done.update(outcome.done)
        failed.update(outcome.failed)
        if set(done) | set(failed) < reqs:
            time.sleep(interval)
    return done, failed


# --------------------------------------------------------------------------- the demo


def check_request(cluster: Cluster, tokens: np.ndarray, decode_table: np.ndarray, prefill_table: np.ndarray,
                  first_block: int) -> list[str]:
    """Mismatches of one request: decode vs prefill (moved blocks, whole) and decode vs the formula (every token).

    Tables are a uniform table's row, or head-wise ``[heads, blocks]``: then only the (block, head)
    units the decode table holds are checked, moved ones where the prefill table holds them too.
    """
    problems = []
    decode_table, prefill_table = np.atleast_2d(decode_table), np.atleast_2d(prefill_table)
    decode = cluster.read(cluster.decode_workers, decode_table)
    prefill = cluster.read(cluster.prefill_workers, prefill_table)
    n = decode_table.shape[-1]
    want, valid = cluster.expected(tokens, n)
    cells = cells_of(cluster.spec, decode_table)
    for i, (d, p, w) in enumerate(zip(decode, prefill, want)):
        layer, tensor = divmod(i, len(cluster.spec.tensors()))
        held = (decode_table[cells[layer]] >= 0).T  # [block, head] units the decode node holds in this layer
        moved = held & (prefill_table[cells[layer]] >= 0).T
        moved[:first_block] = False
        held &= moved | (np.arange(n) < first_block)[:, None]  # the rest was never meant to arrive
        if not np.array_equal(d[moved], p[moved]):
            problems.append(f"layer {layer} tensor {tensor}: decode blocks differ from prefill's")
        mask = np.broadcast_to(held[:, :, None, None] & valid[:, None, :, None], d.shape)
        if not np.array_equal(d[mask], w[mask]):
            problems.append(f"layer {layer} tensor {tensor}: decode KV differs from the model's")
    return problems


def table_of(placed: Any) -> np.ndarray:
    """What a worker and ``check_request`` take: a uniform table's row, or a head-wise table whole."""
    table = np.asarray(placed.table)
    return (table[0] if table.shape[0] == 1 else table).copy()


def run_batch(cluster: Cluster, proxy: Any, prompts: dict[Any, np.ndarray], *, layer_delay: float = 0.0,
              timeout: float = 30.0, hand_plans: bool = True) -> dict[str, Any]:
    """Submit, prefill, transfer and check one batch of concurrent requests; the decode side frees them after.

    ``hand_plans``: the step carries the plans the prefill admits returned, as a scheduler would
    (else the messagers fetch them from the prefill daemon).
    """
    t0 = time.perf_counter()
    submitted = {}
    for req, tokens in prompts.items():
        placed = proxy.submit(req, tokens)
        if placed is None:
            raise RuntimeError(f"no room for request {req!r}")
        submitted[req] = placed
    items = [(req, tokens, table_of(submitted[req][1]), submitted[req][1].num_cached_tokens)
             for req, tokens in prompts.items()]
    plans = {req: placed[1].plan for req, placed in submitted.items()} if hand_plans else None
    last_signal_ns = cluster.step(items, layer_delay, plans=plans).last_ns
    ready, failed = wait_outcomes(proxy.decode, set(prompts), timeout)
    sent, failed_p = wait_outcomes(proxy.prefill, set(prompts), timeout)
    elapsed = time.perf_counter() - t0
    problems = [f"{req!r}: decode failed: {e}" for req, e in failed.items()]
    problems += [f"{req!r}: prefill failed: {e}" for req, e in failed_p.items()]
    problems += [f"{req!r}: never ready" for req in prompts if req not in ready and req not in failed]
    moved = 0
    bs = cluster.spec.block_size
    for req, tokens in prompts.items():
        reservation, admission = submitted[req]
        first = reservation.num_cached_tokens // bs
        dst, src = np.asarray(reservation.table)[:, first:], np.asarray(admission.table)[:, first:]
        per_row = ((dst >= 0) & (src >= 0)).sum(axis=1)  # blocks moved of each row
        heads = cluster.spec.num_kv_heads  # a (layer, head) of a block: one head's share of the layer's block
        moved += per_row[cells_of(cluster.spec, dst)].sum() * cluster.spec.bytes_per_block_per_layer / heads
        if req in ready:
            problems += [f"{req!r}: {p}" for p in check_request(
                cluster, tokens, table_of(reservation), table_of(admission), first)]
            proxy.decode.free(req)  # decoding would start here; the demo ends the request
    tail_ms = (max(ready.values()) - last_signal_ns) / 1e6 if ready else float("nan")
    return {"requests": len(prompts), "tokens": int(sum(t.size for t in prompts.values())),
            "decode_cached": {r: int(s[0].num_cached_tokens) for r, s in submitted.items()},
            "prefill_cached": {r: int(s[1].num_cached_tokens) for r, s in submitted.items()},
            "bytes": int(moved * cluster.spec.tp_size), "seconds": elapsed, "tail_ms": tail_ms, "problems": problems}


def scenario(rng: np.random.Generator, block_size: int) -> list[tuple[str, dict[str, np.ndarray], str | None]]:
    """Batches of (name, prompts, whose prefix cache to clear first): fresh, both hit, prefill hit, decode hit."""
    base = {f"r{i}": rng.integers(0, 50_000, n) for i, n in enumerate((37, 300, 5 * block_size + 1, 1000))}
    def longer(tag: str) -> dict[str, np.ndarray]:
        return {f"{tag}{k}": np.concatenate([v, rng.integers(0, 50_000, 40)]) for k, v in base.items()}
    return [("fresh prompts", base, None), ("prefix hits on both nodes", longer("both-"), None),
            ("prefix hits on prefill only", longer("p-"), "decode"), ("prefix hits on decode only", longer("d-"), "prefill")]

