"""Tests of jaxtier.offload, jaxtier.plan and jaxtier.calibrate end to end (jaxtier/_src/api.py)."""
