"""The math every decoder shares, one owner each: `ops` (norms, linears and packed GEMM kinds, RoPE,
attention), `moe` (routers, expert dispatch), `kv_cache` (the one slot KV cache), `decoder` (the packed
decoder stack and its one layer function), `kernels` (CPU-only native kernels)."""
