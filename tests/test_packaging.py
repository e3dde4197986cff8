"""A regular (non-editable) install carries every package folder, the examples and the C extensions, and is the
package a process uses wherever it starts, the source checkout's root included."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy
import pytest

from kvcache.launch import stop_serve, wait_ready

ROOT = Path(__file__).resolve().parents[1]
# The dependencies' folder, on PYTHONPATH for `python -S`: -S skips site's .pth files, so an editable install of this
# checkout (how the tests run) cannot map allocator/, transfer/ and ops/ for a process that should see a normal one.
DEPENDENCIES = str(Path(numpy.__file__).resolve().parents[1])


@pytest.fixture(scope="module")
def wheel_site(tmp_path_factory) -> tuple[Path, Path]:
    """The package built as a wheel and installed (without dependencies) into a folder: (wheel, folder)."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist")],
        check=True, capture_output=True, timeout=600,
    )
    (wheel,) = (tmp_path / "dist").glob("kvcache-*.whl")
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    return wheel, site


def installed_env(site: Path) -> dict[str, str]:
    """The environment of a process that has only the installed wheel and the dependencies."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), DEPENDENCIES]))


def test_wheel_installs_and_runs_outside_the_source_tree(wheel_site, tmp_path):
    """`pip install .` maps allocator/, transfer/, ops/ into kvcache.* and ships what the CLI needs."""
    wheel, site = wheel_site
    names = zipfile.ZipFile(wheel).namelist()
    for expected in ("kvcache/allocator/layout.py", "kvcache/transfer/__init__.py", "kvcache/ops/__init__.py",
                     "kvcache/examples/llama-3.1-70b.json", "kvcache/examples/gemma-3-4b.json",
                     "kvcache/examples/gpt-oss-20b.json", "kvcache/cli.py", "kvcache/bench/allocator.py"):
        assert expected in names
    for extension in ("kvcache/allocator/_chainhash", "kvcache/allocator/_hashtable", "kvcache/allocator/_tables",
                      "kvcache/allocator/_pool",
                      "kvcache/ops/_send_cache",
                      "kvcache/transfer/_copy", "kvcache/transfer/_tier"):
        assert any(n.startswith(extension) and n.endswith(".so") for n in names), f"{extension} not built"
    env = dict(os.environ, PYTHONPATH=str(site))
    probe = (
        "import kvcache, kvcache.allocator, kvcache.transfer, kvcache.ops, json, sys;"
        "from kvcache.allocator import BlockHasher, KVCacheManager;"
        "assert BlockHasher(16).native;"
        "m = KVCacheManager(8, 4); m.admit(0, list(range(9)));"
        "print(kvcache.__file__);"
        "from kvcache.cli import main; sys.exit(main(['plan', '--json']))"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    first, rest = result.stdout.split("\n", 1)
    assert first.startswith(str(site)), f"imported {first}, not the installed wheel"
    assert '"num_blocks"' in rest


def test_python_m_kvcache_in_the_checkouts_root_runs_the_installed_package(wheel_site):
    """In the checkout's root its kvcache/ folder comes first on sys.path; the installed package is used instead."""
    _, site = wheel_site
    probe = "import kvcache, kvcache.allocator, kvcache.cli; print(kvcache.__file__, kvcache.allocator.__file__)"
    result = subprocess.run([sys.executable, "-S", "-c", f"import sys; sys.path.insert(0, ''); {probe}"], cwd=ROOT,
                            env=installed_env(site), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert [Path(p).parents[1] for p in result.stdout.split()] == [site, site / "kvcache"]
    plan = subprocess.run([sys.executable, "-S", "-m", "kvcache", "plan", "--json"], cwd=ROOT,
                          env=installed_env(site), capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    assert '"num_blocks"' in plan.stdout


def test_a_daemon_started_in_the_checkouts_root_with_a_normal_install_serves(wheel_site, tmp_path):
    """`python -m kvcache serve` from the checkout's root (how tools and examples start daemons) gets ready."""
    _, site = wheel_site
    endpoint, log = f"ipc://{tmp_path}/kvcache.sock", tmp_path / "serve.log"
    with open(log, "wb") as out:
        daemon = subprocess.Popen([sys.executable, "-S", "-m", "kvcache", "serve", "--num-blocks", "16",
                                   "--endpoint", endpoint], cwd=ROOT, env=installed_env(site), stdout=out,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_ready(daemon, log)
        assert f"ready endpoint={endpoint}" in log.read_text()
    finally:
        stop_serve(daemon)
    assert daemon.returncode == 0, log.read_text()


def test_a_checkout_that_is_not_installed_names_the_install_command(tmp_path):
    """Without any install, importing the checkout's kvcache says how to install it, in one line."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), DEPENDENCIES]))
    result = subprocess.run([sys.executable, "-S", "-c", "import kvcache"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert f"kvcache: {ROOT} is a source checkout that is not installed; install it with `pip install -e {ROOT}`" \
        in result.stderr.strip().splitlines()[-1]


API_PAGES = {"allocator.html": ("KVCacheManager", "CacheSpec"), "transfer.html": ("TransferManager",),
             "ops.html": ("send_cache",)}


@pytest.mark.parametrize("install", ["editable", "wheel"])
def test_make_docs_has_the_mapped_packages_pages_and_no_warning(install, wheel_site, tmp_path):
    """The API reference documents kvcache.allocator, .transfer and .ops whichever way kvcache is installed."""
    pytest.importorskip("pdoc")
    command = [sys.executable, str(ROOT / "docs" / "build_api.py"), str(tmp_path / "api")]
    env = dict(os.environ)
    if install == "wheel":
        command.insert(1, "-S")
        env = installed_env(wheel_site[1])
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    for page, names in API_PAGES.items():
        text = (tmp_path / "api" / "kvcache" / page).read_text()
        for name in names:
            assert f'id="{name}"' in text, f"{name} missing from {page}"
    assert (tmp_path / "api" / "kvcache" / "allocator" / "manager.html").exists()
    assert (tmp_path / "api" / "kvcache" / "client.html").exists()
