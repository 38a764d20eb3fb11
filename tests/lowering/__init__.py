"""Tests of jaxtier/_src/lowering/: the rewrite into programs, host_stream."""
