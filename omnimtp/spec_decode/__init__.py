"""Speculative decoding: proposers, the rejection sampler, verification with KV rollback, and the packed LLM target."""
