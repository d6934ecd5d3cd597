"""Benchmarks: the workloads of shared/design/BENCH.md, peers run side by side, and the roofline."""
