"""LayerSignal and send_cache's CPU path: the rules a cache messager relies on, checked across real processes."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import resource
import signal as signals
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from kvcache.ops import raw_stream, send_cache
from kvcache.transfer import LayerSignal, WaitStatus, begin_step

SPAWN = mp.get_context("spawn")
NEAR_WRAP = 2**32 - 3


@pytest.fixture
def name() -> Iterator[str]:
    """A fresh shared-memory name; whatever a test leaves under it is removed afterwards."""
    n = f"kvtest-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield n
    LayerSignal.remove(n)


def shm_exists(name: str) -> bool:
    return Path("/dev/shm", name).exists()


# --------------------------------------------------------------------------- helpers run in child processes


def signal_layers(name: str, steps: int, num_layers: int, gap_s: float, go: mp.Event, seen: mp.Semaphore) -> None:
    """Writer: claim the record, then from a thread signal every layer of `steps` steps on the CPU path.

    After each layer it waits until the waiter has seen it (``seen``): a waiter still behind when the layer
    completes a later step would get STALE, however fast it is meant to be.
    """
    sig = LayerSignal.open(name)
    sig.claim_writer()
    go.wait(30)

    def run() -> None:
        for _ in range(steps):
            begin_step(sig)
            for layer in range(num_layers):
                time.sleep(gap_s)
                send_cache(None, sig, layer)
                assert seen.acquire(timeout=60), "the waiter did not see the layer"

    t = threading.Thread(target=run)
    t.start()
    t.join()
    sig.close()


def wait_layers(name: str, first_step: int, steps: int, num_layers: int, timeout: float,
                ready: mp.Queue, results: mp.Queue, seen: mp.Semaphore | None) -> None:
    """Waiter: wait for every layer of steps first_step.., reporting (step, layer, status, woke_ns, done_ns)."""
    sig = LayerSignal.open(name)
    ready.put(os.getpid())
    out = []
    for step in range(first_step, first_step + steps):
        for layer in range(num_layers):
            status = sig.wait(layer, step, timeout)
            woke = time.monotonic_ns()
            done_step, done_ns = sig.record.layer(layer)
            out.append((step, layer, int(status), woke, done_step, done_ns))
            if seen is not None:
                seen.release()
    results.put(out)
    sig.close()


def create_then_hang(name: str, ready: mp.Event) -> None:
    """Writer that creates the record, completes layer 0 of step 1, then hangs until killed."""
    sig = LayerSignal.create(name, 4)
    sig.begin_step()
    sig.complete(0)
    ready.set()
    time.sleep(600)


def start_waiters(name: str, count: int, first_step: int, steps: int, num_layers: int, timeout: float,
                  seen: mp.Semaphore | None = None) -> tuple[list[mp.Process], mp.Queue]:
    """`count` waiter processes, returned once each has opened the record; each releases ``seen`` per wait."""
    ready, results = SPAWN.Queue(), SPAWN.Queue()
    procs = [SPAWN.Process(target=wait_layers,
                           args=(name, first_step, steps, num_layers, timeout, ready, results, seen))
             for _ in range(count)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=60)
    return procs, results


def collect(procs: list[mp.Process], results: mp.Queue, timeout: float = 60) -> list[list[tuple]]:
    out = [results.get(timeout=timeout) for _ in procs]
    for p in procs:
        p.join(10)
        assert p.exitcode == 0
    return out


# --------------------------------------------------------------------------- across processes


def test_waiter_in_another_process_wakes_for_every_layer_in_order_never_early(name):
    """Each wait returns DONE after the layer was signalled, in (step, layer) order, within milliseconds."""
    steps, num_layers = 3, 8
    with LayerSignal.create(name, num_layers):
        seen = SPAWN.Semaphore(0)
        waiters, results = start_waiters(name, 1, 1, steps, num_layers, timeout=10, seen=seen)
        go = SPAWN.Event()
        writer = SPAWN.Process(target=signal_layers, args=(name, steps, num_layers, 0.002, go, seen))
        writer.start()
        go.set()
        (out,) = collect(waiters, results)
        writer.join(10)
    assert [(s, layer) for s, layer, *_ in out] == [(s, layer) for s in range(1, 4) for layer in range(num_layers)]
    assert all(status == WaitStatus.DONE for _, _, status, *_ in out)
    assert all(done_step == s for s, _, _, _, done_step, _ in out)
    assert all(woke >= done_ns for _, _, _, woke, _, done_ns in out), "a waiter woke before the layer was signalled"
    done = [done_ns for *_, done_ns in out]
    assert done == sorted(done)
    assert max(woke - done_ns for _, _, _, woke, _, done_ns in out) < 200e6


def test_every_one_of_many_waiters_wakes(name):
    """Eight processes waiting on the same layers all return DONE for each of them."""
    num_layers = 4
    with LayerSignal.create(name, num_layers) as sig:
        waiters, results = start_waiters(name, 8, 1, 1, num_layers, timeout=10)
        time.sleep(0.05)
        sig.begin_step()
        for layer in range(num_layers):
            sig.complete(layer)
            time.sleep(0.001)
        outs = collect(waiters, results)
    assert len(outs) == 8
    for out in outs:
        assert [(layer, status) for _, layer, status, *_ in out] == [(layer, WaitStatus.DONE) for layer in range(4)]


def test_step_counter_wraps_past_2_32(name):
    """Starting 3 steps below 2**32, steps keep comparing right as the counter wraps to 0 (ints are taken mod 2**32)."""
    steps, num_layers = 6, 2
    with LayerSignal.create(name, num_layers, start_step=NEAR_WRAP) as sig:
        seen = SPAWN.Semaphore(0)
        waiters, results = start_waiters(name, 1, NEAR_WRAP + 1, steps, num_layers, timeout=10, seen=seen)
        go = SPAWN.Event()
        writer = SPAWN.Process(target=signal_layers, args=(name, steps, num_layers, 0.002, go, seen))
        writer.start()
        go.set()
        (out,) = collect(waiters, results)
        writer.join(10)
        assert all(status == WaitStatus.DONE for _, _, status, *_ in out)
        assert [done_step for *_, done_step, _ in out[-2:]] == [(NEAR_WRAP + steps) % 2**32] * 2
        assert sig.step == (NEAR_WRAP + steps) % 2**32 == 3
        assert sig.wait(0, 2**32 - 1, timeout=0) == WaitStatus.STALE  # a step before the wrap is older
        assert sig.wait(0, 4, timeout=0) == WaitStatus.WRITER_DEAD  # one after it won't come: the writer closed
        sig.claim_writer()
        assert sig.wait(0, 4, timeout=0) == WaitStatus.TIMEOUT


def test_killed_writer_is_reported_long_before_the_timeout(name):
    """SIGKILL of the writer: a waiter with a 30 s timeout returns WRITER_DEAD within about liveness_interval (0.5 s)."""
    ready = SPAWN.Event()
    writer = SPAWN.Process(target=create_then_hang, args=(name, ready))
    writer.start()
    assert ready.wait(60)
    waiters, results = start_waiters(name, 1, 1, 1, 2, timeout=30)
    time.sleep(0.2)
    killed = time.monotonic_ns()
    os.kill(writer.pid, signals.SIGKILL)  # not joined yet: the writer stays a zombie meanwhile
    (out,) = collect(waiters, results)
    writer.join(10)
    assert [status for _, _, status, *_ in out] == [WaitStatus.DONE, WaitStatus.WRITER_DEAD]
    assert (out[1][3] - killed) / 1e9 < 2.0
    assert shm_exists(name), "a killed creator leaves its record behind"
    with LayerSignal.create(name, 4, replace=True) as fresh:
        assert fresh.writer_pid == os.getpid()
    assert not shm_exists(name)


# --------------------------------------------------------------------------- one process


def test_wait_times_out_at_the_deadline(name):
    """A layer that never completes: TIMEOUT after the timeout, at once with timeout 0, writer alive."""
    with LayerSignal.create(name, 2) as sig:
        reader = LayerSignal.open(name)
        t0 = time.monotonic()
        assert reader.wait(1, 0, timeout=0.2) == WaitStatus.TIMEOUT
        assert 0.2 <= time.monotonic() - t0 < 0.7
        t0 = time.monotonic()
        assert reader.wait(1, 0, timeout=0) == WaitStatus.TIMEOUT
        assert time.monotonic() - t0 < 0.05
        assert sig.writer_alive and reader.writer_alive
        reader.close()


def test_done_layer_returns_at_once_and_stale_step_is_reported(name):
    """DONE for the step the layer completed in; STALE for an earlier step once it has completed a later one."""
    with LayerSignal.create(name, 3, start_step=7) as sig:
        sig.complete(1)
        assert sig.wait(1, 7, timeout=0) == WaitStatus.DONE
        assert sig.begin_step() == 8
        assert sig.wait(1, 7, timeout=0) == WaitStatus.DONE  # still the latest completion of layer 1
        assert sig.wait(1, 8, timeout=0) == WaitStatus.TIMEOUT
        sig.complete(1)
        assert sig.wait(1, 7, timeout=0) == WaitStatus.STALE
        assert sig.wait(1, 8) == WaitStatus.DONE


def test_progress_and_layer_times_record_each_completion(name):
    """progress() holds the newest step's highest layer; layer_times() each layer's step and monotonic time."""
    with LayerSignal.create(name, 4) as sig:
        step = sig.begin_step()
        assert sig.progress().step == step and sig.progress().last_layer == -1
        before = time.monotonic_ns()
        for layer in (0, 1, 2):
            send_cache(None, sig, layer)
        after = time.monotonic_ns()
        assert sig.progress().last_layer == 2
        times = sig.layer_times()
        assert times.steps.tolist() == [step, step, step, -1]
        assert times.done_ns.dtype == np.int64 and times.done_ns[3] == 0
        assert before <= times.done_ns[0] <= times.done_ns[1] <= times.done_ns[2] <= after
        sig.begin_step()
        assert sig.progress().last_layer == -1


def test_writer_close_wakes_waiters_at_once(name):
    """A waiter with no liveness checks for a minute still returns WRITER_DEAD as soon as the writer closes."""
    sig = LayerSignal.create(name, 2)
    reader = LayerSignal.open(name)
    out: list[tuple[WaitStatus, float]] = []
    t = threading.Thread(target=lambda: out.append((reader.wait(0, 1, 30, liveness_interval=60), time.monotonic())))
    t.start()
    time.sleep(0.1)
    closed = time.monotonic()
    sig.close()
    t.join(5)
    assert out[0][0] == WaitStatus.WRITER_DEAD and out[0][1] - closed < 0.5
    assert not shm_exists(name) and not reader.writer_alive
    assert reader.record.layer(0) == (-1, 0), "an opener's mapping outlives the name"
    reader.close()


def test_idle_waiter_uses_no_cpu(name):
    """Half a second of waiting costs under 5 ms of this thread's CPU (it sleeps in the kernel)."""
    with LayerSignal.create(name, 1) as sig:
        r0 = resource.getrusage(resource.RUSAGE_THREAD)
        assert sig.wait(0, 1, timeout=0.5) == WaitStatus.TIMEOUT
        r1 = resource.getrusage(resource.RUSAGE_THREAD)
    assert (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime) < 0.005


def test_ctrl_c_interrupts_a_wait(name):
    """SIGINT reaches a waiter blocked with no timeout: it raises KeyboardInterrupt."""
    with LayerSignal.create(name, 1):
        # The handler is set explicitly: a child started while a thread of this process is in C's system() (which
        # sets SIGINT and SIGQUIT to ignored meanwhile) inherits SIGINT ignored, and Python then installs none.
        code = ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
                f"from kvcache.transfer import LayerSignal; s = LayerSignal.open({name!r}); print('ready', flush=True);"
                "s.wait(0, 1)")
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"
        time.sleep(0.1)  # most often blocked in the wait by now; a SIGINT taken just before it works the same
        p.send_signal(signals.SIGINT)
        try:
            _, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            state = process_state(p.pid)
            p.kill()
            raise AssertionError(f"SIGINT did not end the wait; the waiter was:\n{state}") from None
    assert p.returncode != 0 and "KeyboardInterrupt" in err


def process_state(pid: int) -> str:
    """Each thread's state, signal masks and kernel wait channel (for a failure message)."""
    lines = []
    for tid in sorted(os.listdir(f"/proc/{pid}/task")):
        task = Path(f"/proc/{pid}/task/{tid}")
        status = dict(line.split(":\t", 1) for line in (task / "status").read_text().splitlines() if ":\t" in line)
        wchan = (task / "wchan").read_text() if (task / "wchan").exists() else "?"
        lines.append(f"{tid}: {status.get('State')} wchan={wchan} " +
                     " ".join(f"{k}={status.get(k)}" for k in ("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")))
    return "\n".join(lines)


# --------------------------------------------------------------------------- lifetime and errors


def test_creator_close_removes_the_name(name):
    """close() (or leaving the with block) unlinks /dev/shm/<name>; closing twice is fine."""
    sig = LayerSignal.create(name, 2)
    assert shm_exists(name)
    sig.close()
    sig.close()
    assert not shm_exists(name) and sig.closed
    with pytest.raises(ValueError, match="closed"):
        sig.begin_step()


def test_creator_exit_removes_the_name(name):
    """A creator that exits without closing still removes its record."""
    subprocess.run([sys.executable, "-c", f"from kvcache.transfer import LayerSignal; s = LayerSignal.create({name!r}, 4)"],
                   check=True, timeout=60)
    assert not shm_exists(name)


def test_a_forked_child_closing_its_copy_changes_nothing(name):
    """A child forked from the writer (engines fork workers) may close its inherited copy: the record stays, writer alive."""
    with LayerSignal.create(name, 1) as sig:
        child = mp.get_context("fork").Process(target=sig.close)
        child.start()
        child.join(10)
        assert child.exitcode == 0
        assert shm_exists(name) and sig.writer_alive


def test_failed_create_leaves_nothing_and_keeps_the_existing_record(name):
    """Bad arguments create nothing; a taken name raises FileExistsError and leaves the record as it was."""
    with pytest.raises(ValueError, match="num_layers"):
        LayerSignal.create(name, 0)
    assert not shm_exists(name)
    with pytest.raises(ValueError, match="name"):
        LayerSignal.create("a/b", 2)
    with LayerSignal.create(name, 2) as sig:
        sig.complete(1)
        with pytest.raises(FileExistsError):
            LayerSignal.create(name, 5)
        with LayerSignal.open(name) as reader:
            assert reader.num_layers == 2 and reader.wait(1, 0, timeout=0) == WaitStatus.DONE


def test_open_checks_the_name_and_the_contents(name):
    """A missing name raises FileNotFoundError; a file that is not a layer signal raises ValueError."""
    with pytest.raises(FileNotFoundError):
        LayerSignal.open(name)
    Path("/dev/shm", name).write_bytes(b"x" * 512)
    with pytest.raises(ValueError, match="not a kvcache layer signal"):
        LayerSignal.open(name)


def test_layer_out_of_range_is_an_error(name):
    with LayerSignal.create(name, 3) as sig:
        for bad in (-1, 3):
            with pytest.raises(ValueError, match="out of range"):
                send_cache(None, sig, bad)
            with pytest.raises(ValueError, match="out of range"):
                sig.wait(bad, 0, timeout=0)


# --------------------------------------------------------------------------- send_cache's stream argument


def _has_gpu() -> bool:
    return Path("/dev/nvidia0").exists() or Path("/dev/nvidiactl").exists()


@pytest.mark.skipif(_has_gpu(), reason="a GPU is present: stream 0 would really be queued on")
def test_a_stream_without_a_usable_cuda_runtime_is_a_clear_error(name):
    """Without a GPU, a stream (even 0, the legacy default stream) raises RuntimeError; only None means now."""
    with LayerSignal.create(name, 1) as sig:
        with pytest.raises(RuntimeError, match="CUDA|cuda"):
            send_cache(0, sig, 0)
        assert sig.wait(0, 0, timeout=0) == WaitStatus.TIMEOUT
        with pytest.raises(TypeError, match="CUDA stream"):
            send_cache("stream", sig, 0)


def test_raw_stream_reads_each_framework_form():
    """Ints pass through; the CUDA stream protocol, cuda_stream, stream_base and ptr are read; None stays None."""

    class Protocol:
        def __cuda_stream__(self) -> tuple[int, int]:
            return (0, 0x1234)

    class TorchLike:
        cuda_stream = 0x10

    class PaddleCore:
        raw_stream = 0x20

    class PaddleStream:
        stream_base = PaddleCore()

    class CupyLike:
        ptr = 0x30

    assert raw_stream(None) is None and raw_stream(0) == 0 and raw_stream(7) == 7
    assert [raw_stream(s) for s in (Protocol(), TorchLike(), PaddleStream(), CupyLike())] == [0x1234, 0x10, 0x20, 0x30]
    with pytest.raises(TypeError):
        raw_stream(object())


def test_cpu_paddle_tensor_signals_at_once(name):
    """A Paddle model runner on CPU passes its cache tensor: the layer is marked immediately."""
    paddle = pytest.importorskip("paddle")
    cache = paddle.zeros([4, 8], dtype="float32").cpu()
    with LayerSignal.create(name, 2) as sig:
        assert raw_stream(cache) is None
        send_cache(cache, sig, 1)
        assert sig.wait(1, 0, timeout=0) == WaitStatus.DONE


# --------------------------------------------------------------------------- the benchmark


def test_bench_signal_runs_and_reports_every_target(capsys):
    """`kvcache bench signal --samples 50 --json`: CPU sections measured, CUDA skipped without a GPU, exit 0."""
    from kvcache.bench import signal as bench
    from kvcache.bench.common import run_alone

    assert run_alone(bench.add_parser, "signal", ["--samples", "50", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["cpu"]["ours"]["samples"] + result["cpu"]["not_done"] == 50
    assert result["cpu"]["idle_cpu_ms"] is not None
    names = [t["name"] for t in result["targets"]]
    assert names[:2] == ["CPU path signal-to-wake p50", "idle waiter CPU over 1 s"]
    assert (result["gpu"] is None) == (len(names) == 2)
    assert "targets met" in bench.render(result)
