"""Benchmarks: each script prints side-by-side figures and ratios measured in one run."""
