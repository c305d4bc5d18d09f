"""Model construction helpers: tiny seeded configs built from real transformers config classes."""
