"""The Qwen3-Omni talker side: code predictor, talker inputs, talker loop."""
