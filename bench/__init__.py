"""Benchmarks: each prints its figures as ratios to a baseline measured in the same run."""
