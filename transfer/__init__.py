"""Moving KV blocks: layer signals, registered memory, transfer engines, cache messager."""
