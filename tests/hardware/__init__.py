"""Tests of jaxtier/_src/hardware/: the hardware profile, its storage and calibration."""
