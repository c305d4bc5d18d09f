"""MTP speculative decoding: NextN head, drafting, verification, rejection sampling, training."""
