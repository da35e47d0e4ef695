"""Benchmarks: trace loaders, the forward-time cost model, the replay CLI and its calibration."""
