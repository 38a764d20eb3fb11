"""Tests of the example decoder, its data pipeline and trainer (jaxtier/examples/)."""
