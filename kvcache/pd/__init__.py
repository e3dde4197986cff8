"""Prefill/decode disaggregation: the daemon's transfer state, the workers' links and the scheduler's proxy.

    state.py      PDState: reservations and transfers in a daemon (``--role prefill|decode``)
    messager.py   CacheMessager (a prefill rank: each layer's blocks to the decode ranks over NIXL) and
                  CacheReceiver (a decode rank: completion notices)
    links.py      PrefillLink and DecodeLink: a messager or receiver tied to its daemon
    process.py    MessagerProcess and ReceiverProcess: the same in a process of their own
    proxy.py      PDProxy: reserve on decode, then admit on prefill with that destination
    cluster.py    a local prefill/decode pair with fake model workers (the demo, tests and benchmark)

A request moves from a prefill node to a decode node like this (each arrow one daemon op)::

    proxy/scheduler          decode daemon (--role decode)         prefill daemon (--role prefill)
    reserve(req, tokens) ->  admit, matching the decode prefix cache;
                             "receiving" until a deadline; result: table,
                             cached tokens, the decode ranks' receivers,
                             its rows
    admit(req, tokens, dest={receivers, table, cached, decode, rows}) ->  refused unless the rows match its own;
                                                                          admit (its own prefix hits skip
                                                                          compute); "sending" until a deadline
    prefill messagers:                                                    plans(reqs) -> what to write where
      write each layer's blocks past the decode side's cache
      over NIXL, a notification with the last write
    decode receivers:        received(req, rank) from every decode rank:
                             "ready" (once requests it shares
                             still-arriving blocks with are ready too)
    messagers:                                                            sent(req, rank) from every prefill rank:
                                                                          freed (blocks stay cached)
    schedulers: pd_poll() -> {"done": [[req, t_ns]], "failed": [[req, error]]}

Failures (transfer_failed from either side, cancel, a deadline passing) release the request on
that daemon, and the error reaches its scheduler through ``pd_poll``. Decode blocks that never got
their data leave the prefix index (``KVCacheManager.discard``), so nobody hits garbage. A
cancelled request's blocks are kept until the writers stop (a report from every rank, a failure,
or the deadline). A write can land after its deadline (TCP retransmits what a downed link held
once it is back), so a decode request failing at its deadline is reported at once but keeps its
blocks until every decode rank that had not reported it says its writers stopped (``received``),
or one more timeout passes. A prefill messager that gives a request up with a write not landed
tells the decode ranks it wrote to; each receiver resets that messager's NIXL connections into it
(``NixlEngine.cut_off``) before it reports. Over TCP no write of an expired request then lands in
blocks handed on, provided that word arrives within the extra timeout. Not covered: no word in
time (a dead or long cut-off prefill node; keep the decode side's TCP keepalive under the
timeout), RDMA (nothing to reset; untested), and a failure reported before the deadline, which
releases at once.
"""
from __future__ import annotations

import importlib
from typing import Any

# Imported on first use: the client imports kvcache.pd.state, and the links import the client.
_HOMES = {"CacheMessager": "messager", "CacheReceiver": "messager", "Chunk": "messager", "TransferPlan": "messager",
          "DecodeLink": "links", "PrefillLink": "links", "MessagerProcess": "process", "ReceiverProcess": "process",
          "PDProxy": "proxy"}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'kvcache.pd' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kvcache.pd.{_HOMES[name]}"), name)
