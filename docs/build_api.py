"""Write the API reference (`make docs`): one pdoc page per public module of kvcache, into the folder given.

Usage: python docs/build_api.py OUT_DIR [--list]. Fails, naming each, on any warning pdoc gives.
"""
from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import sys
import typing
import warnings
from pathlib import Path

# Mapped into kvcache.* from top-level folders (pyproject.toml): an editable install's kvcache.__path__ does not
# list them, so they are named here.
MAPPED = ("kvcache.allocator", "kvcache.transfer", "kvcache.ops")


def public_modules() -> list[str]:
    """kvcache and every module under it whose name has no leading underscore, parents before children."""
    found: dict[str, None] = {}

    def walk(name: str) -> None:
        if name in found:
            return
        found[name] = None
        module = importlib.import_module(name)
        for info in pkgutil.iter_modules(getattr(module, "__path__", []), f"{name}."):
            if not info.name.rpartition(".")[2].startswith("_"):
                walk(info.name)

    for name in ("kvcache", *MAPPED):
        walk(name)
    return list(found)


def pdoc_specs(modules: list[str]) -> list[str]:
    """The modules to name to pdoc: those its walk from a module named before (it follows a package's
    ``__all__``) does not reach already, so each page is asked for once."""
    import pdoc.extract

    specs: list[str] = []
    reached: set[str] = set()
    for name in modules:
        if name not in reached:
            specs.append(name)
            ispkg = hasattr(importlib.import_module(name), "__path__")
            reached.update(m.name for m in pdoc.extract.walk_packages2([pkgutil.ModuleInfo(None, name, ispkg)]))
    return specs


def resolve_named_tuple_signatures(modules: list[str]) -> None:
    """Give each NamedTuple's generated ``__new__`` its fields' resolved types.

    ``__new__`` is compiled outside the class's module, so string annotations naming that module's types
    cannot be resolved from it; the class's own hints can.
    """
    for name in modules:
        for _, cls in inspect.getmembers(importlib.import_module(name), inspect.isclass):
            if cls.__module__ == name and issubclass(cls, tuple) and hasattr(cls, "_fields"):
                hints = typing.get_type_hints(cls)
                cls.__new__.__annotations__.update({k: v for k, v in hints.items() if k in cls._fields})


def load_lazy_exports(modules: list[str]) -> None:
    """Import the names a module exports through a module ``__getattr__``, so that pdoc finds them in ``__all__``."""
    for name in modules:
        module = importlib.import_module(name)
        if "__getattr__" in vars(module):
            for export in getattr(module, "__all__", ()):
                setattr(module, export, getattr(module, export))


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.splitlines()[2], file=sys.stderr)
        return 2
    modules = public_modules()
    if "--list" in argv:
        print("\n".join(modules))
        return 0
    import pdoc
    import pdoc.render

    resolve_named_tuple_signatures(modules)
    load_lazy_exports(modules)
    pdoc.render.configure(docformat="markdown", template_directory=Path(__file__).parent / "api-template")
    out = Path(argv[0]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.chdir(out)  # pdoc takes a name that is also a folder where it runs (the checkout's kvcache/) as that folder
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pdoc.pdoc(*pdoc_specs(modules), output_directory=out)
    for warning in caught:
        print(f"make docs: {warning.message}", file=sys.stderr)
    return 1 if caught else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
