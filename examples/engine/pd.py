"""Prefill/decode disaggregation for the reference engine: two engines, two daemons, KV moved layer by layer.

The prefill engine admits through ``PDProxy`` (a decode reservation, then a
prefill admit with that destination), computes each prompt and samples its
first token; after each layer's K and V are written its ``send_cache`` wakes
the ``CacheMessager`` (``PrefillLink``), which writes that layer's blocks
into the decode engine's cache over NIXL (``DecodeLink``'s receiver). Once
the decode daemon reports a request ready, the decode engine takes it over
with its first token and decodes on, attending over the blocks that arrived.
"""
from __future__ import annotations

import uuid
from typing import Any

from kvcache.ops import send_cache
from kvcache.pd import PDProxy
from kvcache.pd.cluster import wait_outcomes
from kvcache.pd.links import DecodeLink, PrefillLink
from kvcache.pd.messager import Chunk
from kvcache.transfer import KVRegion, LayerSignal

from engine import Engine, daemon_engine
from model import Model
from paged_cache import cache_spec
from sequence import Sequence


class _ProxyCache:
    """The prefill engine's cache: its daemon's client, but admits go through the PD proxy (decode reservation,
    then a prefill admit with that destination); each admitted request's transfer plan is kept for its step."""

    def __init__(self, proxy: PDProxy) -> None:
        self.proxy, self.client = proxy, proxy.prefill
        self.plans: dict[Any, Any] = {}
        self.decode_cached: dict[Any, int] = {}

    def admit(self, rid: Any, tokens: list[int], num_tokens: int | None = None) -> Any:
        if num_tokens is not None and num_tokens < len(tokens):
            return None  # whole prompts only: a later step has room for all of it
        placed = self.proxy.submit(rid, tokens)
        if placed is None:
            return None
        reservation, admission = placed
        self.plans[rid] = admission.plan
        self.decode_cached[rid] = reservation.num_cached_tokens
        return admission

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


class PDPair:
    """A prefill engine and a decode engine over the daemons at ``prefill`` (``--role prefill``) and ``decode``
    (``--role decode``), both serving ``model.config.hf_config()``; ``generate`` runs prompts through both."""

    def __init__(self, model: Model, prefill: str, decode: str, *, block_size: int = 4, head_wise: bool = False,
                 quant: str = "none", chunk: int = 256, timeout: float = 20.0, prefill_tp: int = 1,
                 decode_model: Model | None = None) -> None:
        """``prefill_tp`` ranks on the prefill node (the prefill daemon's ``--tp``), each a process with its own
        cache and messager; the decode node has one. ``decode_model``: the same model on the decode node's device
        (another GPU: its cache lives there and NIXL writes it GPU to GPU); default ``model``."""
        self.model, self.timeout = model, timeout
        self.spec = cache_spec(model.config, block_size=block_size, head_wise=head_wise, quant=quant)
        self.signal = LayerSignal.create(f"kvcache-engine-{uuid.uuid4().hex[:12]}", self.spec.num_layers)
        self.parts: list[Any] = [self.signal]
        options = dict(block_size=block_size, head_wise=head_wise, quant=quant, chunk=chunk)
        try:
            self.prefill = daemon_engine(model, prefill, tp=prefill_tp, prefill=True, **options)
            self.parts.append(self.prefill)
            if prefill_tp == 1:  # TP ranks have a messager each
                self.link = PrefillLink(prefill, self._region(self.prefill), self.signal, 0)
                self.parts.append(self.link)
            self.decode = daemon_engine(decode_model or model, decode, **options)
            self.parts.append(self.decode)
            self.receiver = DecodeLink(decode, self._region(self.decode), 0)
            self.parts.append(self.receiver)
        except BaseException:
            self.close()
            raise
        self.proxy = PDProxy(self.prefill.cache, self.decode.cache)
        self.prefill.scheduler.cache = _ProxyCache(self.proxy)
        self.handed: list[Sequence] = []
        self.prefill.scheduler.handoff = self.handed.append
        self.prefill.runner.on_step = self._send
        if prefill_tp == 1:  # TP ranks signal their own layers
            stream = model.ops.write_stream()
            self.prefill.runner.on_layer = lambda layer: send_cache(stream, self.signal, layer)

    def _region(self, engine: Engine) -> KVRegion:
        views = engine.paged.views if engine.paged is not None else engine.attention.views
        return KVRegion.from_tensors(self.spec, [views(layer) for layer in range(self.spec.num_layers)])

    def _send(self, items: list[Any]) -> None:
        """Before a prefill step's layers: the messagers learn which requests' blocks to send as layers finish."""
        chunks = [Chunk(item.rid, item.stop, True) for item in items]
        held = self.prefill.cache.plans
        plans = {item.rid: held.pop(item.rid) for item in items if item.rid in held}
        if hasattr(self.prefill.attention, "begin_step"):
            self.prefill.attention.begin_step(chunks, plans)
        else:
            self.link.run_step(self.signal.begin_step(), chunks, plans)

    def generate(self, prompts: dict[Any, list[int]], max_new_tokens: int) -> dict[Any, Sequence]:
        """Prefill every prompt on the prefill node, move its KV, decode it to ``max_new_tokens`` on the decode node."""
        for rid, prompt in prompts.items():
            self.prefill.add(rid, prompt, max_new_tokens)
        while self.prefill.waiting or self.prefill.running:
            self.prefill.step()
        handed, self.handed[:] = list(self.handed), []
        ready, failed = wait_outcomes(self.decode.cache, {s.rid for s in handed}, self.timeout)
        wait_outcomes(self.prefill.cache.client, {s.rid for s in handed}, self.timeout)
        if failed or len(ready) < len(handed):
            raise RuntimeError(f"transfers failed: {failed}; ready {sorted(ready)}")
        for s in handed:  # the decode node holds the prompt's KV: decode from the first sampled token on
            s.computed = s.scheduled = s.prompt_len
            if len(s.generated) >= s.max_new_tokens:
                self.decode.cache.free(s.rid)
                self.decode.finished[s.rid] = s
            else:
                self.decode.running.append(s)
        while self.decode.running:
            self.decode.step()
        if self.decode.agent is not None:
            # Between steps a decode worker runs the copies its daemon ordered: the frees' offloads land before the
            # next reservations take their blocks (which the prefill node writes outside the workers' order).
            self.decode.tables.wait_for(self.decode.cache.last_seq, timeout=self.timeout)
            self.decode.agent.drain(self.timeout)
        return {rid: self.decode.finished.pop(rid) for rid in prompts}

    def hit_tokens(self) -> tuple[int, int]:
        """Prefix-hit tokens so far on the prefill node and on the decode node."""
        return (sum(s.hit for s in self.prefill.stats), sum(self.prefill.cache.decode_cached.values()))

    def close(self) -> None:
        for part in reversed(self.parts):
            try:
                part.close()
            except Exception:  # closing what is left matters more than the first failure
                pass
        LayerSignal.remove(self.signal.name)
