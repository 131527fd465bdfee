"""Benchmarks of omnifleet: each prints ratios against limits measured in the same run.

Run one as `python -m bench.<name> [--quick]`; results go to bench/results/.
"""
