"""Benchmarks: workloads, offline runs, reports."""
