"""Oracles shared by the tests and the benchmarks (float64 references, host-side builds)."""
