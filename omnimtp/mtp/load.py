"""Loading an MTP checkpoint: the target causal LM and its NextN head (`MTPHead`), from a float checkpoint or from
`omnimtp quantize`'s copy of one."""

from __future__ import annotations

import os

import torch

from omnimtp.mtp.head import MTPHead, enable_transformers_mtp


def load_target_and_head(checkpoint_dir: str | os.PathLike, dtype: torch.dtype | None = None):
    """Load `(target, head)` from a checkpoint dir that holds the target and its NextN layer; the target is
    in eval mode and already pointed at the layer for transformers' `generate(use_mtp=True)`.

    A quantized checkpoint (`omnimtp quantize` of an MTP family's) loads memory-mapped instead
    (`omnimtp.quantized_checkpoint.load_quantized_target_and_head`): its target runs only quantized, in the
    checkpoint's mode, on the packed backend of `speculative_generate` / `plain_generate`; dtype: its float tensors'
    (default the config's)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    from omnimtp.checkpoint import is_shipped
    from omnimtp.console import progress_bars_off
    from omnimtp.quantized_checkpoint import is_quantized_checkpoint, load_quantized_target_and_head

    checkpoint_dir = os.fspath(checkpoint_dir)
    if not os.path.isdir(checkpoint_dir):
        raise ValueError(f"checkpoint_dir: {checkpoint_dir!r} is not a directory")
    if is_quantized_checkpoint(checkpoint_dir):
        return load_quantized_target_and_head(checkpoint_dir, dtype=dtype)
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # the MTP keys are "unexpected" for the target class; that is fine
    try:
        # dtype=None passed explicitly makes transformers take the weights' storage dtype; "auto" honours
        # the config's dtype first (checkpoints stored in bf16 with a float32 config load as float32).
        with progress_bars_off(is_shipped(checkpoint_dir)):
            target = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=dtype or "auto").eval()
    finally:
        logging.set_verbosity(verbosity)
    enable_transformers_mtp(target)
    return target, MTPHead.from_pretrained(checkpoint_dir, target).eval()
