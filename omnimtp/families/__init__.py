"""Model families behind the engine's interface: one module per family (Qwen3-Omni today)."""
