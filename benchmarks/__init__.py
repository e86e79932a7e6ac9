"""Benchmarks of sebp_jax: one layer, whole models, the selection, the kernels' tiles."""
