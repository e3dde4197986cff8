"""A decode link across its daemon's restart without a journal, and the link processes claiming their ranks with the
worker's key file or the daemon's admin key, against real `kvcache serve` daemons."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from kvcache.allocator.errors import KVCacheError
from kvcache.client import CacheClient, DaemonError
from kvcache.launch import start_serve, stop_serve
from kvcache.rank_keys import admin_key, rank_key
from kvcache.transfer import KVRegion, LayerSignal
from kvcache.transfer.nixl import nixl_available
from kvcache.transfer.sharing import SharedHostBuffer

needs_nixl = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed (pip install nixl-cu12 --no-deps)")

DECODE = ("--num-blocks", "32", "--block-size", "16", "--role", "decode")
PREFILL = ("--num-blocks", "32", "--block-size", "16", "--role", "prefill")


def spec_and_cache(blocks: int = 32) -> tuple[Any, Any]:
    from kvcache.pd.cluster import Cache, spec_of

    spec = spec_of(dict(layers=2, kv_heads=2, head_dim=16, block_size=16), 1)
    return spec, Cache(spec, blocks, "cpu")


def cpu_region(blocks: int = 32) -> KVRegion:
    spec, cache = spec_and_cache(blocks)
    return KVRegion.from_tensors(spec, cache.layers)


def until(check: Callable[[], Any], timeout: float, what: str) -> Any:
    """``check()``'s first truthy result, polled until ``timeout`` seconds; fails naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g} s"
        time.sleep(0.1)


def reserved(client: CacheClient, req: str, tokens: np.ndarray) -> Any:
    """The reservation, or None while the daemon refuses it for a rank with no receiver."""
    try:
        return client.reserve(req, tokens)
    except DaemonError as exc:
        assert "receiver" in str(exc), exc
        return None


@needs_nixl
def test_a_decode_link_attaches_again_after_its_daemon_restarts_without_a_journal(daemon, caplog) -> None:
    """kill -9 the decode daemon (no journal) and start it again on the same socket: the new daemon knows no receiver
    and refuses every reservation. The link notices the new epoch, attaches its receiver again with its key within
    its watch period, says so in one line, and its reports count there."""
    from kvcache.pd.links import DecodeLink

    caplog.set_level(logging.WARNING, logger="kvcache.pd.links")
    d = daemon(*DECODE)
    with DecodeLink(d.endpoint, cpu_region(), 0, watch=0.2) as link:
        with CacheClient(d.endpoint, timeout=5) as c:
            assert list(c.reserve("a", np.arange(40)).receivers) == [link.receiver.endpoint]
        d.kill()
        again = daemon(*DECODE, folder=d.folder)
        with CacheClient(again.endpoint, timeout=5) as c:
            reservation = until(lambda: reserved(c, "b", np.arange(40) + 500), 20, "reserve on the restarted daemon")
            assert list(reservation.receivers) == [link.receiver.endpoint]
            link.wait_attached(0)
            assert link.attached
            link._received(["b"])  # the receiver's report, with the key it attached with: it counts
            assert list(c.pd_poll().done) == ["b"]
            c.free("b")
            c.check_integrity()
        lines = [r.getMessage() for r in caplog.records if "attached receiver" in r.getMessage()]
        assert len(lines) == 1 and "restarted without its state" in lines[0] and link.receiver.endpoint in lines[0]


@needs_nixl
def test_a_decode_link_without_its_daemon_says_so_and_waits_with_a_deadline(daemon, caplog) -> None:
    """While its daemon is gone the link logs it once and ``wait_attached`` gives up at its deadline, naming why;
    a daemon started again (no journal) gets the receiver back."""
    from kvcache.pd.links import DecodeLink

    caplog.set_level(logging.WARNING, logger="kvcache.pd.links")
    d = daemon(*DECODE)
    with DecodeLink(d.endpoint, cpu_region(), 0, watch=0.2, timeout=0.5) as link:
        d.kill()
        until(lambda: any("does not answer" in r.getMessage() for r in caplog.records), 10, "the lost daemon's line")
        again = daemon(*DECODE, folder=d.folder)
        link.wait_attached(20)
        with CacheClient(again.endpoint, timeout=5) as c:
            assert list(c.reserve("a", np.arange(40)).receivers) == [link.receiver.endpoint]
    with pytest.raises(KVCacheError, match="watch: must be >= 0"):
        DecodeLink("ipc:///nonexistent/k.sock", cpu_region(), 0, watch=-1)


# --------------------------------------------------------------------------- the link processes' keys


def tcp_daemon(endpoint: str, folder: Path, *flags: str) -> Any:
    """A tcp:// daemon without CURVE: a worker's rank key is random unless it passes a ``key_file``."""
    return start_serve(["--endpoint", endpoint, *flags], folder / "serve.log")


def _claim(link: Any, region: KVRegion) -> int:
    """In a MessagerProcess's child: claim the rank on the prefill daemon (as before a first plans) and say with
    which key."""
    link._claimed()
    return link.key


@needs_nixl
def test_a_receiver_process_restarted_with_its_key_file_attaches_its_rank_again(tcp_endpoint, tmp_path) -> None:
    """On a tcp:// daemon without CURVE only a ``key_file`` lets a restarted worker claim its rank again: the
    ReceiverProcess's child claims with the worker's key file (and reports count with that key); one without it
    is refused by name."""
    from kvcache.pd.process import ReceiverProcess

    spec, _ = spec_and_cache()
    key_file = tmp_path / "decode-rank-0.key"
    process = tcp_daemon(tcp_endpoint, tmp_path, *DECODE)
    try:
        with SharedHostBuffer(spec.cache_bytes(32)) as buf:
            region = KVRegion.from_buffer(spec, 32, buf.array.ctypes.data, keep=(buf,))
            ReceiverProcess(tcp_endpoint, region, 0, key_file=key_file, start_timeout=120).close()
            key = rank_key(tcp_endpoint, 0, key_file=key_file)
            with ReceiverProcess(tcp_endpoint, region, 0, key_file=key_file, start_timeout=120) as link, \
                    CacheClient(tcp_endpoint, timeout=5) as c:
                assert list(c.reserve("a", np.arange(40)).receivers) == [link.listen_endpoint]
                c.received("a", 0, key=key)  # the worker's key is the file's
                assert list(c.pd_poll().done) == ["a"]
                with pytest.raises(KVCacheError, match="attach of decode rank 0 refused"):
                    ReceiverProcess(tcp_endpoint, region, 0, start_timeout=120)  # a random key of its own
    finally:
        stop_serve(process)


@needs_nixl
def test_link_processes_claim_their_ranks_with_the_key_file_or_the_daemons_admin_key(daemon, tmp_path) -> None:
    """A rank claimed with a worker's key file is taken again by a MessagerProcess / ReceiverProcess given that file,
    refused to one given another, and taken by one given the daemon's admin key (which then owns it)."""
    from kvcache.pd.process import MessagerProcess, ReceiverProcess

    spec, _ = spec_and_cache()
    prefill, decode = daemon(*PREFILL), daemon(*DECODE)
    key_file, other_file = tmp_path / "rank-0.key", tmp_path / "other.key"
    key = rank_key(prefill.endpoint, 0, key_file=key_file)
    with CacheClient(prefill.endpoint, timeout=5) as p, CacheClient(decode.endpoint, timeout=5) as c:
        p.attach(0, key=key)  # the worker's earlier run claimed both ranks with its key file
        c.attach(0, "tcp://127.0.0.1:1", key=key)
        with SharedHostBuffer(spec.cache_bytes(32)) as buf, \
                LayerSignal.create(f"kvcache-test-keys-{os.getpid()}", spec.num_layers, replace=True) as sig:
            region = KVRegion.from_buffer(spec, 32, buf.array.ctypes.data, keep=(buf,))
            with MessagerProcess(prefill.endpoint, region, sig, 0, key_file=key_file, start_timeout=120) as link:
                assert link.call(_claim) == key
            with MessagerProcess(prefill.endpoint, region, sig, 0, key_file=other_file, start_timeout=120) as link:
                with pytest.raises(KVCacheError, match="attach of prefill rank 0 refused"):
                    link.call(_claim)
            with MessagerProcess(prefill.endpoint, region, sig, 0, key_file=other_file,
                                 admin=admin_key(prefill.endpoint), start_timeout=120) as link:
                assert link.call(_claim) == rank_key(prefill.endpoint, 0, key_file=other_file)
            with ReceiverProcess(decode.endpoint, region, 0, key_file=key_file, start_timeout=120) as link:
                assert list(c.reserve("a", np.arange(40)).receivers) == [link.listen_endpoint]
                c.received("a", 0, key=key)
                assert list(c.pd_poll().done) == ["a"]
            with pytest.raises(KVCacheError, match="attach of decode rank 0 refused"):
                ReceiverProcess(decode.endpoint, region, 0, key_file=other_file, start_timeout=120)
            with ReceiverProcess(decode.endpoint, region, 0, key_file=other_file, admin=admin_key(decode.endpoint),
                                 start_timeout=120) as link:
                assert list(c.reserve("b", np.arange(40) + 500).receivers) == [link.listen_endpoint]
                with pytest.raises(DaemonError, match="received for rank 0"):
                    c.received("b", 0, key=key)  # the old owner's key no longer counts
                c.received("b", 0, key=rank_key(decode.endpoint, 0, key_file=other_file))
                assert list(c.pd_poll().done) == ["b"]
