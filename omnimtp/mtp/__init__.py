"""MTP (NextN) heads: the head per family, its training by self-distillation, and the shipped demo checkpoint."""
