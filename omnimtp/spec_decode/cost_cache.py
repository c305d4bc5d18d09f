"""Calibrated draft costs kept on disk, so a second start on the same model and machine measures nothing.

Other measured costs use the same cache under their own directory (`read_entry` / `write_entry` with a `kind`):
admission's speech step costs (`omnimtp.server.admission`).

An entry is one JSON file under `cache_root()/draft_costs/` named by a digest of its fingerprint: the model
(its directory and the sizes and modification times of the files there, its config, its parameters' names,
shapes and dtypes), the drafter's (class, parameters), the machine (CPU model, cores, torch version and
threads), the device, the native kernel that runs (`small_batch_linear.build_id`), omnimtp's own code (a
digest of its sources) and the measurement's own key (batch size, sampling, k up to ...). Every part a
step's time depends on is in it, so a change of any (new weights, another thread count, a rebuilt kernel,
another omnimtp) names another file and the costs are measured again. A file that does not parse, whose
fingerprint is not the one asked for, or whose costs are not valid is ignored (and replaced by the new
measurement). Writing is atomic (a reader sees a whole entry or none); a cache directory that cannot be
written leaves the costs measured every start. OMNIMTP_DRAFT_COST_CACHE=0 in the environment turns the
cache off (every process measures; what a benchmark wants, so that costs measured under another load do
not decide its runs).

    fingerprint = cost_fingerprint(model, drafter, key={"batch_size": 4, "sampled": False})
    entry = read_costs(fingerprint)            # ([c_0, c_1, ...], acceptance or None) or None
    write_costs(fingerprint, [1.0, 1.2, 1.5], acceptance=0.8)
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import platform
import tempfile
from pathlib import Path

import torch

from omnimtp.runtime.cache_dir import cache_root
from omnimtp.runtime.kernels import small_batch_linear

FORMAT = 2  # bump when an entry's meaning changes


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _parameters_digest(module) -> str | None:
    parameters = getattr(module, "named_parameters", None)
    if parameters is None:
        return None
    return _digest(";".join(f"{name}:{tuple(p.shape)}:{p.dtype}" for name, p in parameters()))


def _directory_files(path: str) -> list | None:
    """[(name, size, mtime_ns)] of the files in a model directory, or None when path is not one."""
    if not path or not os.path.isdir(path):
        return None
    entries = sorted(os.scandir(path), key=lambda entry: entry.name)
    return [[e.name, e.stat().st_size, e.stat().st_mtime_ns] for e in entries if e.is_file()]


@functools.cache
def _code_digest() -> str:
    """A digest of omnimtp's Python and C sources (what the measured loop runs, its kernels included)."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted([*package.rglob("*.py"), *package.rglob("*.c")]):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cost_fingerprint(
    model, drafter, *, key: dict, device: str | torch.device = "cpu", model_path: str | os.PathLike | None = None
) -> dict:
    """What a calibrated cost depends on (see the module docstring); key: the measurement's own settings
    (JSON values); model_path: the directory the model was loaded from, where the model does not say (a
    sub-model such as an omni model's thinker)."""
    config = getattr(model, "config", None)
    path = str(model_path or getattr(model, "name_or_path", "") or getattr(config, "_name_or_path", "") or "")
    drafter_config = getattr(drafter, "config", None)
    return {
        "format": FORMAT,
        "model": {
            "path": os.path.abspath(path) if path and os.path.isdir(path) else path,
            "files": _directory_files(path),
            "config": _digest(config.to_json_string()) if hasattr(config, "to_json_string") else None,
            "parameters": _parameters_digest(model),
        },
        "drafter": {
            "class": type(drafter).__qualname__,
            "config": _digest(drafter_config.to_json_string()) if hasattr(drafter_config, "to_json_string") else None,
            "parameters": _parameters_digest(drafter),
        },
        "machine": {
            "cpu": _cpu_model(), "arch": platform.machine(), "cores": os.cpu_count(), "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
        "device": str(device),
        "kernel": small_batch_linear.build_id(),
        "code": _code_digest(),
        "key": key,
    }


def _entry_path(fingerprint: dict, kind: str = "draft_costs") -> Path:
    return cache_root() / kind / f"{_digest(json.dumps(fingerprint, sort_keys=True))}.json"


def is_enabled() -> bool:
    return os.environ.get("OMNIMTP_DRAFT_COST_CACHE", "1") != "0"


def read_entry(fingerprint: dict, kind: str = "draft_costs") -> dict | None:
    """The JSON entry kept for exactly this fingerprint under `kind` (a directory of the cache), or None (none,
    unreadable, another fingerprint's, or the cache turned off)."""
    if not is_enabled():
        return None
    try:
        entry = json.loads(_entry_path(fingerprint, kind).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("fingerprint") != json.loads(json.dumps(fingerprint)):
        return None
    return entry


def write_entry(fingerprint: dict, payload: dict, kind: str = "draft_costs") -> bool:
    """Keep payload (JSON values) for this fingerprint under `kind` (atomically: a reader sees a whole entry or
    none); False when the cache directory cannot be written or the cache is turned off."""
    if not is_enabled():
        return False
    target = _entry_path(fingerprint, kind)
    try:
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=target.parent, suffix=".tmp", delete=False) as tmp:
            json.dump({"fingerprint": fingerprint, **payload}, tmp, indent=1)
        os.replace(tmp.name, target)
    except OSError:
        with contextlib.suppress(OSError, NameError):
            os.unlink(tmp.name)
        return False
    return True


def read_costs(fingerprint: dict) -> tuple[list[float], float | None] | None:
    """The cached costs [c_0, c_1, ...] and the drafts' acceptance measured with them (None when none was)
    for exactly this fingerprint, or None (none, unreadable, corrupt, or the cache turned off)."""
    entry = read_entry(fingerprint)
    if entry is None:
        return None
    steps = entry.get("step")
    if not isinstance(steps, list) or not all(
        isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) for c in steps
    ):
        return None
    acceptance = entry.get("acceptance")
    if acceptance is not None and (isinstance(acceptance, bool) or not isinstance(acceptance, (int, float))
                                   or not 0.0 <= acceptance <= 1.0):
        return None
    return [float(c) for c in steps], None if acceptance is None else float(acceptance)


def write_costs(
    fingerprint: dict, steps: list[float] | tuple[float, ...], acceptance: float | None = None
) -> bool:
    """Keep the costs (and the acceptance measured with them) for this fingerprint (atomically); False when
    the cache directory cannot be written or the cache is turned off."""
    return write_entry(fingerprint, {"step": list(steps), "acceptance": acceptance})
