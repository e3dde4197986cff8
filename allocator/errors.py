"""The one exception type the package raises for caller mistakes."""
from __future__ import annotations


class KVCacheError(ValueError):
    """A caller mistake (bad field, unknown id, impossible size); state is unchanged.

    Lives in the lowest package that needs it so every layer can raise it
    without importing upwards; ``kvcache.KVCacheError`` is the same class.
    """
