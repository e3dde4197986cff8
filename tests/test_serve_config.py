"""Every `kvcache serve` setting is checked for type and range once, in ServeConfig, for flags and TOML alike: bad
input is one line naming the setting and exit status 2, sizes that follow from input are bounded before anything is
allocated, and no command takes an abbreviated flag."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.allocator import KVCacheError
from kvcache.cli import build_parser
from kvcache.config import MAX_BLOCKS, MAX_ROWS, ServeConfig, load_toml, parse_rows
from kvcache.serve import build_manager

INT_FIELDS = [f.name for f in dataclasses.fields(ServeConfig) if f.type == "int"]
FLOAT_FIELDS = [f.name for f in dataclasses.fields(ServeConfig) if f.type == "float"]
STR_FIELDS = [f.name for f in dataclasses.fields(ServeConfig) if f.type == "str"]
HUGE_MODEL = {"num_hidden_layers": 10**9, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}


@pytest.fixture
def sockets() -> Iterator[Path]:
    """A short folder for ipc:// sockets (a Unix socket's path takes 107 bytes; pytest's tmp_path may be longer)."""
    folder = Path(tempfile.mkdtemp(prefix="kv-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def run_kvcache(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvcache", *args], capture_output=True, text=True, timeout=timeout)


def assert_one_line(result: subprocess.CompletedProcess[str], command: str, message: str) -> None:
    """Exit status 2 and exactly one line on stderr, ``kvcache COMMAND: error: MESSAGE...``; no traceback."""
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith(f"kvcache {command}: error: {message}"), result.stderr


# (setting, value, the error's start): each refused the same way from a flag and from --config (where a string
# value is quoted).
BAD_SETTINGS = [
    ("num_blocks", -5, "num_blocks: must be an integer in [0, 268435456]"),
    ("lease_timeout", -3, "lease_timeout: must be a number in [0, 604800] seconds"),
    ("lease_timeout", math.nan, "lease_timeout: must be a number in [0, 604800] seconds"),
    ("heartbeat_ms", 0, "heartbeat_ms: must be an integer in [10, 60000]"),
    ("heartbeat_ms", -100, "heartbeat_ms: must be an integer in [10, 60000]"),
    ("tp", 0, "tp: must be an integer in [1, 1024]"),
    ("metrics_port", 70000, "metrics_port: must be an integer in [0, 65535]"),
    ("block_size", 2**63 - 1, "block_size: must be an integer in [1, 1048576]"),
    ("utilization", 0, "utilization: must be a number in (0, 1]"),
    ("utilization", math.nan, "utilization: must be a number in (0, 1]"),
    ("transfer_timeout", math.inf, "transfer_timeout: must be a number in (0, 604800]"),
    ("max_tokens", 2**31, "max_tokens: must be an integer in [1, 2147483647]"),
    ("rows", "full*100000000", "rows: 'full*100000000' gives more than 4096 rows"),
    ("quant", "int3", "quant: 'int3' is not one of 'none', "),
    ("scale_layout", "hopper", "scale_layout: 'hopper' is not one of 'default', 'blackwell'"),
    ("dtype", "int3", "dtype: unknown model dtype 'int3'"),
    ("hash_algorithm", "md5", "hash_algorithm: 'md5' is not one of 'sha256', 'sha256_cbor'"),
    ("gpu_memory", "2000TB", "gpu_memory: '2000TB' is over the limit of 1 PiB"),
    ("endpoint", "tcp://127.0.0.1:99999", "endpoint: port 99999"),
]


@pytest.mark.parametrize("name, value, message", BAD_SETTINGS, ids=[f"{b[0]}={b[1]}" for b in BAD_SETTINGS])
def test_a_bad_setting_is_one_line_naming_it_from_a_flag_and_from_toml(tmp_path, sockets, name, value, message):
    """The same check runs for both: ServeConfig's, before any socket, thread or pool exists."""
    endpoint = ["--endpoint", f"ipc://{sockets}/k.sock"] if name != "endpoint" else []
    flag = f"--{name.replace('_', '-')}"
    assert_one_line(run_kvcache("serve", *endpoint, f"{flag}={value}"), "serve", message)
    config = tmp_path / "kvcache.toml"
    config.write_text(f"[serve]\n{name} = {json.dumps(value) if isinstance(value, str) else value}\n")
    assert_one_line(run_kvcache("serve", *endpoint, "--config", str(config)), "serve", message)
    assert list(sockets.iterdir()) == []


def test_a_metrics_port_in_use_is_one_line_and_leaves_no_socket_behind(sockets):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_kvcache("serve", "--endpoint", f"ipc://{sockets}/k.sock", "--num-blocks", "8",
                             "--metrics-port", str(port), timeout=30)
    assert_one_line(result, "serve", f"metrics_port: cannot serve on 127.0.0.1:{port}: Address already in use")
    assert list(sockets.iterdir()) == []


def test_a_config_file_that_is_not_utf8_is_one_line(tmp_path):
    config = tmp_path / "kvcache.toml"
    config.write_bytes(b"num_blocks = 5\n# \xff\xfe\n")
    assert_one_line(run_kvcache("serve", "--config", str(config)), "serve",
                    f"--config: {config} is not UTF-8 text (byte 17)")


@pytest.mark.parametrize("text, message", [
    ("serve = 5\n", "--config: serve must be a table of settings, got 5"),
    (f"num_blocks = {'9' * 5000}\n", "--config: "),
])
def test_a_config_file_of_the_wrong_shape_is_one_line(tmp_path, text, message):
    config = tmp_path / "kvcache.toml"
    config.write_text(text)
    with pytest.raises(KVCacheError, match=f"^{message}"):
        load_toml(config)
    assert_one_line(run_kvcache("serve", "--config", str(config)), "serve", message)


def test_a_model_of_a_billion_layers_is_refused_before_its_rows_are_built(tmp_path, sockets):
    """A config.json's layer count sizes per-layer rows and tables: it is bounded first (within a second, not the
    gigabytes and tens of seconds a billion-entry row takes)."""
    model = tmp_path / "config.json"
    model.write_text(json.dumps(HUGE_MODEL))
    message = "num_layers: must be at most 4096, got 1000000000"
    endpoint = ("--endpoint", f"ipc://{sockets}/k.sock")
    assert_one_line(run_kvcache("serve", *endpoint, "--model", str(model), timeout=20), "serve", message)
    config = tmp_path / "kvcache.toml"
    config.write_text(f"model = {json.dumps(str(model))}\n")
    assert_one_line(run_kvcache("serve", *endpoint, "--config", str(config), timeout=20), "serve", message)


@pytest.mark.parametrize("flags, message", [
    (["--layers", "1000000000", "--kv-heads", "8", "--head-dim", "128"], "num_layers: must be at most 4096"),
    (["--block-size", str(2**63 - 1)], "block_size: must be at most 1048576"),
    (["--layers", "4096", "--kv-heads", "4096", "--head-dim", "128"], "num_kv_heads: 4096 layers x 4096 kv heads"),
    (["--example", "llama-3.1-8b", "--tp", "100000"], "tp_size: must be at most 1024"),
])
def test_plan_refuses_absurd_geometry_in_one_line(flags, message):
    assert_one_line(run_kvcache("plan", *flags, timeout=20), "plan", message)


@pytest.mark.parametrize("timeout", ["inf", "nan", "0", "86401"])
def test_a_tools_timeout_is_finite_seconds_in_one_line(sockets, timeout):
    """A daemon tool's --timeout becomes a socket's milliseconds: infinity was a traceback, not an error."""
    result = run_kvcache("stats", "--endpoint", f"ipc://{sockets}/k.sock", "--timeout", timeout, timeout=20)
    assert_one_line(result, "stats", "--timeout: must be positive seconds, at most 86400, got ")


def test_an_abbreviated_flag_is_refused_not_taken_for_the_long_one(sockets):
    """`--num-block 5` once started a daemon of --num-blocks 5; a typo must not pick a setting."""
    result = run_kvcache("serve", "--endpoint", f"ipc://{sockets}/k.sock", "--num-block", "5", timeout=20)
    assert result.returncode == 2 and "unrecognized arguments: --num-block 5" in result.stderr
    assert list(sockets.iterdir()) == []


def test_no_parser_of_the_kvcache_command_takes_abbreviations():
    pending, seen = [build_parser()], []
    while pending:
        parser = pending.pop()
        seen.append(parser.prog)
        assert parser.allow_abbrev is False, parser.prog
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                pending.extend(action.choices.values())
    assert {"kvcache serve", "kvcache plan", "kvcache bench daemon", "kvcache journal check"} <= set(seen)


def test_every_number_setting_has_a_range_and_refuses_what_lies_outside():
    """No int or float field goes unchecked: -1, 2**63, NaN and infinity are refused naming the field."""
    for name in INT_FIELDS:
        for bad in (-1, 2**63):
            with pytest.raises(KVCacheError, match=f"^{name}: must be "):
                ServeConfig(**{name: bad})
    for name in FLOAT_FIELDS:
        for bad in (-1.0, math.nan, math.inf):
            with pytest.raises(KVCacheError, match=f"^{name}: must be a number in "):
                ServeConfig(**{name: bad})


@pytest.mark.parametrize("name", INT_FIELDS)
def test_each_int_setting_takes_both_ends_of_its_range(name):
    """The bound a message states is the bound applied: its ends build, one past them does not."""
    with pytest.raises(KVCacheError, match=f"^{name}: must be an integer in ") as refused:
        ServeConfig(**{name: 2**63})
    least, most = (int(n) for n in str(refused.value).split("[", 1)[1].split("]", 1)[0].split(", "))
    assert getattr(ServeConfig(**{name: least}), name) == least
    assert getattr(ServeConfig(**{name: most}), name) == most
    with pytest.raises(KVCacheError, match=f"^{name}: "):
        ServeConfig(**{name: most + 1})
    with pytest.raises(KVCacheError, match=f"^{name}: "):
        ServeConfig(**{name: least - 1})


def _builds_or_names(name: str, value: object) -> None:
    """ServeConfig(name=value) builds and resolves, or raises KVCacheError naming ``name`` (an endpoint: it or an
    endpoint whose default it gives)."""
    names = [name] if name != "endpoint" else [n for n in STR_FIELDS if n.endswith("endpoint")]
    try:
        ServeConfig(**{name: value}).resolved()
    except KVCacheError as exc:
        assert str(exc).split(":", 1)[0] in names, (name, value, str(exc))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(INT_FIELDS), st.integers() | st.integers(min_value=-(2**70), max_value=2**70))
def test_any_int_for_an_int_setting_builds_or_names_the_setting(name, value):
    _builds_or_names(name, value)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(FLOAT_FIELDS), st.floats(allow_nan=True, allow_infinity=True))
def test_any_float_for_a_number_setting_builds_or_names_the_setting(name, value):
    _builds_or_names(name, value)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(STR_FIELDS), st.text(max_size=40) | st.from_regex(r"(full|window:[0-9]{1,22}(:[0-9]{1,3})?)"
                                                                         r"(\*[0-9]{1,12})?(,full)?", fullmatch=True))
def test_any_text_for_a_string_setting_builds_or_names_the_setting(name, value):
    _builds_or_names(name, value)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(INT_FIELDS + FLOAT_FIELDS + STR_FIELDS),
       st.none() | st.booleans() | st.lists(st.integers(), max_size=2) | st.dictionaries(st.text(max_size=3),
                                                                                        st.integers(), max_size=2))
def test_any_other_type_is_refused_naming_the_setting(name, value):
    with pytest.raises(KVCacheError, match=f"^{name}: must be "):
        ServeConfig(**{name: value})


@pytest.mark.parametrize("spec, message", [
    (f"full*{MAX_ROWS + 1}", "gives more than 4096 rows"),
    ("full*4000,window:8*97", "gives more than 4096 rows"),
    ("full*\u00b2", "cannot read"),  # a digit to str.isdigit, not to int()
    ("window:\u0663", "cannot read"),
    (f"window:{'9' * 5000}", "cannot read"),
    ("window:0", "a window needs 1 to 2147483647 tokens"),
    (f"window:{2**31}", "a window needs 1 to 2147483647 tokens"),
    ("window:8:99999999999", "a sink at most 2147483647"),
    ("full*0", "bad repeat count"),
])
def test_rows_are_counted_and_bounded_before_they_are_built(spec, message):
    with pytest.raises(KVCacheError, match=f"^rows: .*{message}"):
        parse_rows(spec)


def test_rows_up_to_the_bound_parse():
    assert len(parse_rows(f"full*{MAX_ROWS - 1},window:8")) == MAX_ROWS


def test_a_daemons_row_pools_times_blocks_are_bounded_before_the_manager_allocates():
    """Distinct row policies each get a pool of num_blocks: their product is what the manager allocates."""
    rows = ",".join(f"window:{w}" for w in range(1, 65))
    cfg = ServeConfig(num_blocks=MAX_BLOCKS // 64 + 1, block_size=4, rows=rows)
    with pytest.raises(KVCacheError, match=r"^num_blocks: 4194305 blocks in each of 64 row pool\(s\) make "):
        build_manager(cfg.resolved())


def test_a_budget_sizing_more_blocks_than_a_daemon_holds_names_gpu_memory(tmp_path):
    model = tmp_path / "config.json"
    model.write_text(json.dumps({**HUGE_MODEL, "num_hidden_layers": 1}))
    cfg = ServeConfig(model=str(model), block_size=1, gpu_memory="900TB")
    with pytest.raises(KVCacheError, match=r"^gpu_memory: .* more than the 268435456 a daemon holds; lower"):
        build_manager(cfg.resolved())


def test_a_host_tier_of_more_blocks_than_the_bound_names_host_memory(tmp_path):
    model = tmp_path / "config.json"
    model.write_text(json.dumps({**HUGE_MODEL, "num_hidden_layers": 1}))
    cfg = ServeConfig(model=str(model), num_blocks=16, block_size=1, host_memory="900TB")
    with pytest.raises(KVCacheError, match=r"^host_memory: .* more than the 268435456 a host tier holds"):
        build_manager(cfg.resolved())


@pytest.mark.parametrize("fields, message", [
    ({"endpoint": "tcp://127.0.0.1:65535"}, "pub_endpoint: its default, a port after"),
    ({"endpoint": "tcp://127.0.0.1:65535", "pub_endpoint": "tcp://127.0.0.1:6000",
      "replay_endpoint": "tcp://127.0.0.1:6001"}, "events_endpoint: its default"),
    ({"endpoint": "ipc:///tmp/" + "x" * 100 + ".sock"}, "endpoint: '/tmp/x"),
    ({"endpoint": "ipc:///tmp/" + "x" * 90 + ".sock"}, "events_replay_endpoint: '/tmp/x"),
    ({"endpoint": "ipc:///tmp/k.sock", "local_endpoint": "/tmp/" + "x" * 120}, "local_endpoint: '/tmp/x"),
])
def test_endpoints_out_of_a_ports_or_a_unix_paths_range_are_named(fields, message):
    with pytest.raises(KVCacheError, match=f"^{message}"):
        ServeConfig(**fields).resolved()


def test_settings_within_their_ranges_still_start_a_daemon(tmp_path, daemon):
    """The bounds leave real settings alone: a config of ends of ranges serves."""
    config = tmp_path / "kvcache.toml"
    config.write_text('[serve]\nnum_blocks = 64\nblock_size = 1048576\nheartbeat_ms = 10\nlease_timeout = 604800\n'
                      'utilization = 1.0\nrows = "window:2147483647:0,full*4095"\nmetrics_port = 0\n')
    d = daemon("--config", str(config))
    assert Path(d.endpoint.removeprefix("ipc://")).exists()


def test_the_start_up_log_never_shows_the_hash_seed():
    """A secret root only isolates tenants while it stays secret: describe() says whether one is set, not what."""
    described = ServeConfig(num_blocks=8, hash_seed="tenant-secret-41").describe()
    assert "tenant-secret-41" not in described
    assert "  hash_seed = '(set)'" in described.splitlines()
    assert "  hash_seed = ''" in ServeConfig(num_blocks=8).describe().splitlines()
