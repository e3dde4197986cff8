"""`kvcache bench daemon`: the quick run measures every section and leaves no process behind."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvcache.bench import daemon as bench
from kvcache.cli import main

FLAGS = ("--json", "--quick", "--transport", "--steps", "--seconds", "--clients", "--window", "--subscribers",
         "--num-blocks", "--lag-steps", "--profile-steps", "--timeout")


def children() -> list[str]:
    """Command lines of this process's live children (zombies count: they were not waited for)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and "resource_tracker" not in cmdline:
            out.append(cmdline)
    return out


def test_help_explains_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "daemon", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in FLAGS:
        assert flag in text


def test_quick_json_run_reports_every_section(capsys: pytest.CaptureFixture[str]) -> None:
    """Structure and positivity only: no assertion here is about speed."""
    assert main(["bench", "daemon", "--quick", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["benchmark"] == "daemon" and result["config"]["quick"] is True
    assert result["config"]["transport"] == "ipc" and result["config"]["cpus"] >= 1

    echo = result["echo"]
    assert echo["request_bytes"] > echo["reply_bytes"] > 0, "a step sends prompts and gets tables back"
    assert echo["p50_us"] > 0 and echo["p99_us"] >= echo["p50_us"]
    assert echo["pipelined"]["messages_per_s"] > 0

    step = result["step"]
    assert step["steps"] > 0 and step["p99_us"] >= step["p50_us"] > 0
    assert step["echo_p50_us"] == echo["p50_us"] and step["p50_over_echo_p50"] > 0
    assert step["codec_p99_us"] >= step["codec_p50_us"] > 0
    assert step["codec_over_echo_p50"] == pytest.approx(step["codec_p50_us"] / echo["p50_us"])
    assert step["handle_p50_us"] > 0
    if step["vllm"] is None:  # vLLM not importable: no peer, no verdict
        assert step["vllm_p50_us"] is step["vllm_over_p50"] is step["ok"] is None
    else:
        assert step["vllm_p99_us"] >= step["vllm_p50_us"] > 0 and isinstance(step["ok"], bool)
        assert step["vllm_over_p50"] == pytest.approx(step["vllm_p50_us"] / step["p50_us"])
    assert [(r["mode"], r["rows"]) for r in step["rows"]] == list(bench.ROW_MODES)
    for r in step["rows"]:  # head-wise and layer-group daemons, in turns with the uniform one
        assert r["steps"] > 0 and r["p99_us"] >= r["p50_us"] > 0 and r["uniform_p50_us"] > 0
        assert r["over_uniform"] == pytest.approx(r["p50_us"] / r["uniform_p50_us"]) and isinstance(r["ok"], bool)

    rows = result["throughput"]
    assert {(r["path"], r["clients"], r["extends_per_message"]) for r in rows} == {
        ("steps (section 2)", 1, 256),
        *((path, 1, b) for path in ("CacheClient.batch()", "CacheClient.extend_many") for b in (256, 4096)),
        *(("pre-packed extend_many", n, b) for n in (1, 2) for b in (256, 4096)),
        *((f"pre-packed, {bench.PIPELINE_DEPTH} in flight", 1, b) for b in (256, 4096)),
    }
    for r in rows:
        assert r["extends_per_s"] > 0 and r["messages_per_s"] > 0 and r["p50_us"] > 0
        assert r["no_room"] == 0, "the daemon must have room for every extend"

    journal = result["journal"]
    assert {(r["path"], r["clients"], r["extends_per_message"]) for r in journal["rows"]} == {
        ("steps (as in section 2)", 1, 256),
        *((r["path"], r["clients"], r["extends_per_message"]) for r in rows if r["path"] != "steps (section 2)"),
    }, "the journal section runs the step workload and every batched row of section 3"
    for r in journal["rows"]:
        for mode in ("off", "on"):
            assert r[mode]["extends_per_s"] > 0 and r[mode]["messages_per_s"] > 0 and r[mode]["p50_us"] > 0
            assert r[mode]["no_room"] == 0
        assert r["ratio"] == pytest.approx(r["on"]["extends_per_s"] / r["off"]["extends_per_s"])
        assert r["loaded"] == ("in flight" in r["path"]), "only pipelined rows load the daemon"
        assert r["ok"] == ((r["ratio"] >= bench.JOURNAL_RATIO_TARGET) if r["loaded"] else None)
    loaded = [r for r in journal["rows"] if r["loaded"]]
    assert journal["ok"] == all(r["ok"] for r in loaded)
    assert journal["worst_ratio"] == min(r["ratio"] for r in loaded)
    floor = journal["fdatasync"]
    assert floor["bytes"] == 4096 and floor["count"] == 100 and floor["p99_us"] >= floor["p50_us"] > 0
    assert floor["append_p50_us"] > 0
    assert journal["journal_bytes"] > 0 and journal["journal_seconds"] > 0, "the journaled daemon wrote its WAL"
    assert journal["filesystem"] != "unknown"
    assert not os.path.exists(journal["folder"]), "the journal folder is removed afterwards"

    lags = result["lag"]
    assert [lag["transport"] for lag in lags] == ["PUB", "local endpoint"]
    for lag in lags:
        assert lag["subscribers"] == 8 and lag["cpus"] == os.cpu_count()
        assert lag["deltas"] > 0 and lag["received"] == lag["subscribers"] * lag["deltas"]
        assert lag["gaps"] == 0, f"every subscriber must see every seq ({lag['transport']})"
        assert lag["p99_us"] >= lag["p50_us"] > 0 and lag["delta_bytes_mean"] > 0

    profile = result["profile"]
    assert profile["steps"] > 0 and profile["handle_p50_us"] > 0 and profile["profiled_us_per_step"] > 0
    assert profile["handle_events_p50_us"] > 0
    phases = profile["phases"]
    assert any("extend_many" in p["phase"] for p in phases) and any("admit" in p["phase"] for p in phases)
    assert sum(p["us"] for p in phases) == pytest.approx(profile["profiled_us_per_step"])
    assert profile["top"] and all(t["own_us"] > 0 for t in profile["top"])
    native = profile["native_us"]
    assert native["codec"] > 0 and native["allocator"] > 0, "a step decodes, encodes and runs the allocator's C"
    assert native["codec"] + native["allocator"] < profile["handle_p99_us"], "a part of the step's own time"
    assert step["native_floor_us"] == pytest.approx(step["codec_p50_us"] + native["allocator"])
    assert step["native_floor_over_echo_p50"] == pytest.approx(step["native_floor_us"] / echo["p50_us"])

    verdicts = [step["ok"], *(r["ok"] for r in step["rows"]),
                max(r["extends_per_s"] for r in rows) >= bench.EXTENDS_PER_S_TARGET, journal["ok"],
                *(lag["ok"] for lag in lags)]
    assert [t["ok"] for t in result["targets"]] == [v for v in verdicts if v is not None]
    for pid in result["processes"]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert children() == []
    text = bench.render(result)
    for heading in ("1. limit", "2. step round trip", "3. throughput", "3b. journal", "disk floor", "4. delta lag",
                    "5. profile", "targets met"):
        assert heading in text


def test_a_failed_run_stops_every_process_it_started(capsys: pytest.CaptureFixture[str]) -> None:
    """A daemon too small for the workload fails the set-up; the echo server and the daemon still stop."""
    assert main(["bench", "daemon", "--quick", "--num-blocks", "64"]) == 2
    assert "no room" in capsys.readouterr().err
    assert children() == []


@pytest.mark.parametrize("run", [bench._run_client_path, bench._run_arrays_path])
def test_a_client_that_starts_after_its_window_still_sends_one_message(daemon, run) -> None:
    """On a loaded machine a client process may reach its timed run after the window closed: it still measures one
    message, so no row reports 0 extends a second."""
    import time

    from kvcache.client import CacheClient

    d = daemon("--num-blocks", "64")
    with CacheClient(d.endpoint, timeout=10) as client:
        ids = list(range(4))
        for rid in ids:
            assert client.admit(rid, [1, 2, 3]) is not None
        past = time.monotonic() - 1.0
        out = run(client, ids, past - 0.1, past)
    assert out["messages"] == 1 and out["extends"] == 4 and out["p50_us"] > 0 and out["no_room"] == 0
