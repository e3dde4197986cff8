"""pytest plugin: run FastDeploy's own tests with kvcache's cache manager in place of FastDeploy's.

Load it with ``-p fastdeploy_plugin`` (this folder on ``PYTHONPATH``, FastDeploy's sources too). At start-up it
calls ``kvcache.integrations.fastdeploy.install()``, so every ``PrefixCacheManager`` FastDeploy's code or tests
build is kvcache's ``FastDeployCacheManager``. Options:

- ``--fd-platform-cuda``: FastDeploy's platform reports CUDA (``current_platform.is_cuda()`` is true), which
  its v1 scheduler tests need on a CPU machine (elsewhere its engine args turn the v1 scheduler off).
- ``--fd-no-kvcache``: leave FastDeploy's own manager in place (the baseline run).
"""
from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fastdeploy")
    group.addoption("--fd-platform-cuda", action="store_true", help="FastDeploy's platform reports CUDA")
    group.addoption("--fd-no-kvcache", action="store_true", help="keep FastDeploy's own PrefixCacheManager")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--fd-platform-cuda"):
        from fastdeploy.platforms import current_platform

        current_platform.is_cuda = lambda: True
    if not config.getoption("--fd-no-kvcache"):
        from kvcache.integrations.fastdeploy import install

        install()


def pytest_report_header(config: pytest.Config) -> str:
    from fastdeploy.cache_manager import prefix_cache_manager

    cls = prefix_cache_manager.PrefixCacheManager
    return f"fastdeploy PrefixCacheManager: {cls.__module__}.{cls.__qualname__}"
