"""Native ops: the send_cache layer-completion signal and its CPU fallback."""
