"""docs/grafana/kvcache.json queries only what a real `kvcache serve` exports: every series and label its queries,
legends and variables name is on a daemon's /metrics (a decode daemon with a host tier, which exports every family),
and every family the daemon exports has a panel."""
from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvcache.client import CacheClient

from conftest import free_port

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "kvcache.json"
TARGET_LABELS = {"instance", "job"}  # added by Prometheus at scrape time, not by the daemon
SERIES = re.compile(r"\bkvcache_[a-z0-9_]+\b")
SUFFIXES = ("_total", "_created", "_bucket", "_count", "_sum")


def queries() -> list[tuple[str, str]]:
    """(expression, legend) of every panel's targets, and the template variables' queries."""
    dash = json.loads(DASHBOARD.read_text())
    found = [(t["expr"], t.get("legendFormat", "")) for panel in dash["panels"] for t in panel.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            found.append((var["definition"], ""))
    assert found, "the dashboard has no queries"
    return found


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, set[str]]:
    """Each sample name on a real decode daemon's /metrics (with a host tier, after some traffic), with the label
    names its samples carry."""
    from kvcache.launch import start_serve, stop_serve

    folder = tmp_path_factory.mktemp("grafana", numbered=True)
    short = Path("/tmp") / f"kv-graf-{folder.name}"
    short.mkdir()
    port = free_port()
    endpoint = f"ipc://{short}/k.sock"
    process = start_serve(["--endpoint", endpoint, "--role", "decode", "--num-blocks", "64", "--block-size", "16",
                           "--host-block-budget", "32", "--metrics-port", str(port)], folder / "serve.log")
    try:
        with CacheClient(endpoint, timeout=5) as c:
            c.attach(0, "tcp://127.0.0.1:1")
            c.reserve("a", np.arange(40))
            c.cancel("a", release=True)
            c.ping()
        deadline = time.monotonic() + 10
        while True:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
                text = reply.read().decode()
            if "kvcache_operations_total{" in text or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        stop_serve(process)
        for leftover in short.iterdir():
            leftover.unlink()
        short.rmdir()
    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


def test_every_series_the_dashboard_queries_is_one_the_daemon_exports(exported) -> None:
    named = {name for expr, _ in queries() for name in SERIES.findall(expr)}
    assert named, "no kvcache series in the dashboard's queries"
    assert sorted(named - set(exported)) == [], "the dashboard queries series no daemon exports"


def test_every_label_the_dashboard_selects_groups_or_shows_is_on_those_series(exported) -> None:
    """Labels in selectors, ``by (...)`` and legends exist on the series of that query (or are Prometheus's own)."""
    for expr, legend in queries():
        names = SERIES.findall(expr)
        have = set().union(*(exported.get(n, set()) for n in names)) | TARGET_LABELS
        used = set(re.findall(r"(\w+)\s*=~?\s*\"", expr))
        for group in re.findall(r"\bby\s*\(([^)]*)\)", expr):
            used |= {label.strip() for label in group.split(",")}
        used |= set(re.findall(r"\{\{(\w+)\}\}", legend))
        assert used <= have, f"{expr!r} (legend {legend!r}) uses labels {sorted(used - have)} its series lack"


def test_every_family_the_daemon_exports_has_a_panel(exported) -> None:
    """A metric added to the daemon shows up as missing here until the dashboard charts it."""
    families = {_family(name) for name in exported if not name.endswith("_created")}
    charted = {_family(name) for expr, _ in queries() for name in SERIES.findall(expr)}
    assert sorted(families - charted) == []


def test_the_dashboard_covers_what_operators_watch() -> None:
    """Usage per row, hit rate, the host tier, PD transfers, step latency and errors each have a panel."""
    exprs = " ".join(expr for expr, _ in queries())
    for series in ("kvcache_block_usage_ratio", "kvcache_prefix_hit_tokens_total", "kvcache_host_tier_blocks_total",
                   "kvcache_pd_transfers_total", "kvcache_step_seconds_bucket", "kvcache_errors_total"):
        assert series in exprs, series
    assert all(expr.count("(") == expr.count(")") for expr, _ in queries())


def _family(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name
