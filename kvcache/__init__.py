"""kvcache: paged KV-cache allocation and transfer service for LLM inference engines."""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
from typing import Any


def _installed_instead() -> importlib.machinery.ModuleSpec | None:
    """The installed kvcache to load in place of a source checkout's ``kvcache/`` folder, or None where this is it.

    The package maps the checkout's allocator/, transfer/ and ops/ folders into kvcache.*. A process started in
    the checkout's root finds its ``kvcache/`` folder first on sys.path, which alone holds none of them: when no
    editable install maps them, the installed package (later on sys.path) is the one to use.
    """
    if importlib.util.find_spec(f"{__name__}.allocator") is not None:  # installed, or an editable install's mapping
        return None
    checkout = os.path.realpath(os.path.join(os.path.dirname(__file__), os.pardir))
    elsewhere = [p for p in sys.path if os.path.realpath(p or os.curdir) != checkout]
    spec = importlib.machinery.PathFinder.find_spec(__name__, elsewhere)
    if spec is None or spec.loader is None:
        raise ImportError(f"kvcache: {checkout} is a source checkout that is not installed; install it with "
                          f"`pip install -e {checkout}` (or `make install` there)")
    return spec


_installed = _installed_instead()
if _installed is not None:  # the import system hands out whatever sys.modules holds once this module has run
    sys.modules[__name__] = importlib.util.module_from_spec(_installed)
    _installed.loader.exec_module(sys.modules[__name__])  # type: ignore[union-attr]
else:
    __version__ = "0.1.0"
    __all__ = ["CacheSpec", "KVCacheError", "__version__"]


def __getattr__(name: str) -> Any:
    """``CacheSpec`` and ``KVCacheError`` from kvcache.allocator, imported on first use: ``import kvcache`` stays
    light, so the command can catch signals before numpy and the allocator load."""
    if name in ("CacheSpec", "KVCacheError"):
        return getattr(importlib.import_module("kvcache.allocator"), name)
    raise AttributeError(f"module 'kvcache' has no attribute {name!r}")
