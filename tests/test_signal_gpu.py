"""send_cache behind real CUDA kernels: a layer is signalled in stream order, never before its data is written."""
from __future__ import annotations

import os
import uuid
from typing import Iterator

import pytest

torch = pytest.importorskip("torch")

from kvcache.ops import cuda_runtime, raw_stream, send_cache  # noqa: E402
from kvcache.transfer import LayerSignal, WaitStatus  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LAYERS = 12
STEPS = 20
LAYER_FLOATS = 1 << 20
NEAR_WRAP = 2**32 - 5


@pytest.fixture
def name() -> Iterator[str]:
    n = f"kvtest-gpu-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield n
    LayerSignal.remove(n)


def cycles_for(us: float) -> int:
    """torch.cuda._sleep cycles that keep the GPU busy for about `us` microseconds."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    return max(1000, int(1_000_000 * us / (start.elapsed_time(end) * 1e3)))


def value(k: int, layer: int) -> float:
    """What layer `layer` holds once step number k has written it (exact in float32)."""
    return float(k * 1000 + layer + 1)


def verify_layers(name: str, ack_name: str, kv: "torch.Tensor", first_step: int, queue: object) -> None:
    """Messager side, in another process: on each layer's wake, check the whole layer holds this step's value."""
    sig, ack = LayerSignal.open(name), LayerSignal.open(ack_name)
    out = []
    for k in range(STEPS):
        step = (first_step + k) % 2**32
        for layer in range(LAYERS):
            status = sig.wait(layer, step, 30)
            wrong = int((kv[layer] != value(k, layer)).sum()) if status == WaitStatus.DONE else -1
            out.append((k, layer, int(status), wrong))
        ack.begin_step()
        ack.complete(0)
    queue.put(out)
    sig.close()
    ack.close()


def test_the_cuda_runtime_is_found():
    assert "cudart" in (cuda_runtime() or "")


def test_a_layer_is_not_signalled_before_the_kernel_ahead_of_it_ends(name):
    """While a 50 ms kernel runs the layer is pending; when wait returns DONE, an event recorded after it has completed."""
    stream = torch.cuda.Stream()
    with LayerSignal.create(name, 1) as sig, torch.cuda.stream(stream):
        step = sig.begin_step()
        torch.cuda._sleep(cycles_for(50_000))
        kernel_done = torch.cuda.Event()
        kernel_done.record(stream)
        send_cache(stream, sig, 0)
        assert sig.wait(0, step, timeout=0) == WaitStatus.TIMEOUT
        assert sig.wait(0, step, timeout=10) == WaitStatus.DONE
        assert kernel_done.query()


def test_layers_keep_the_step_they_were_queued_in_when_the_cpu_runs_ahead(name):
    """begin_step while step 1's layers are still queued: they complete as step 1, the next as step 2."""
    stream = torch.cuda.Stream()
    with LayerSignal.create(name, 2) as sig, torch.cuda.stream(stream):
        first = sig.begin_step()
        torch.cuda._sleep(cycles_for(20_000))
        send_cache(stream, sig, 0)
        send_cache(stream.cuda_stream, sig, 1)
        second = sig.begin_step()
        send_cache(stream, sig, 0)
        stream.synchronize()
        assert sig.layer_times().steps.tolist() == [second, first]
        assert sig.wait(1, first, timeout=0) == WaitStatus.DONE
        assert sig.wait(0, first, timeout=0) == WaitStatus.STALE
        assert sig.wait(0, second, timeout=0) == WaitStatus.DONE


def test_torch_streams_and_tensors_name_their_stream():
    """A torch.cuda.Stream gives its handle; a CUDA tensor the current stream; a CPU tensor None (signal now)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        assert raw_stream(stream) == stream.cuda_stream
        assert raw_stream(torch.zeros(1, device="cuda")) == stream.cuda_stream
    assert raw_stream(torch.zeros(1)) is None


def test_waiter_in_another_process_sees_every_layer_fully_written(name):
    """12 layers x 20 steps (the step counter wrapping): each layer is written in two kernels with a random
    pause between, then send_cache; a messager in another process, woken per layer, finds every element of
    the layer already holding this step's value. Steps are paced by an ack signal from the messager."""
    mp = torch.multiprocessing.get_context("spawn")
    ack_name = f"{name}-ack"
    kv = torch.zeros(LAYERS, LAYER_FLOATS, device="cuda")
    stream = torch.cuda.Stream()
    half = LAYER_FLOATS // 2
    pauses = torch.randint(1, 200, (STEPS, LAYERS)).tolist()
    per_us = cycles_for(1000) / 1000
    with LayerSignal.create(name, LAYERS, start_step=NEAR_WRAP) as sig, LayerSignal.create(ack_name, 1) as ack:
        queue = mp.Queue()
        messager = mp.Process(target=verify_layers, args=(name, ack_name, kv, NEAR_WRAP + 1, queue))
        messager.start()
        with torch.cuda.stream(stream):
            for k in range(STEPS):
                sig.begin_step()
                for layer in range(LAYERS):
                    kv[layer, :half].fill_(value(k, layer))
                    torch.cuda._sleep(int(pauses[k][layer] * per_us))
                    kv[layer, half:].fill_(value(k, layer))
                    send_cache(kv if layer % 2 else stream, sig, layer)
                assert ack.wait(0, k + 1, timeout=120) == WaitStatus.DONE, f"messager did not finish step {k}"
        out = queue.get(timeout=60)
        messager.join(30)
    assert messager.exitcode == 0
    assert len(out) == STEPS * LAYERS
    assert [(k, layer, status) for k, layer, status, _ in out if status != WaitStatus.DONE] == []
    assert [(k, layer, wrong) for k, layer, _, wrong in out if wrong] == [], "a layer was signalled before it was written"
