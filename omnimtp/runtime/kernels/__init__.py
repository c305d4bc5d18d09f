"""Native CPU kernels, compiled from C on first use (see small_batch_linear.py)."""
