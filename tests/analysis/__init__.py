"""Tests of jaxtier/_src/analysis/: FLOP counting, the timing of scan bodies."""
