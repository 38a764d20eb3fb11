"""Tests of the GPU benchmark scripts in benchmarks/, at toy sizes on the CPU."""
