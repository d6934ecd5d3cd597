"""Benchmarks: the standard workloads (workloads.py), peers run side by side, and the roofline."""
