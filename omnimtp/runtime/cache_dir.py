"""The per-user cache directory omnimtp keeps what it builds or measures in: OMNIMTP_CACHE_DIR, else
$XDG_CACHE_HOME/omnimtp, else ~/.cache/omnimtp (compiled kernels under `kernels/`, calibrated draft costs
under `draft_costs/`)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    root = os.environ.get("OMNIMTP_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "omnimtp"
    )
    return Path(root)
