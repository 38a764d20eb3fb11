"""jaxtier internals. Nothing here is public API; see `jaxtier/__init__.py`."""
