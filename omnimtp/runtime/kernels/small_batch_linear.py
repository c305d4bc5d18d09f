"""fp32 linear layers for a few rows (in passes that read the weights once) that stream their weights at a
core's read bandwidth, on x86 CPUs with AVX-512F or AVX2 + FMA (see the C source for how; `isa()` says which
build runs); their int8 / int4 / w4a8 forms; and a decode step's attention (`decode_attention`: one query
position a row, each key and value read once).

The kernel is small C (`small_batch_linear.c`, next to this file), compiled with the system C compiler
on first use (a few seconds) into a per-user cache directory (OMNIMTP_CACHE_DIR, else ~/.cache/omnimtp)
and loaded with ctypes: no torch headers, no build step at install time. A cached library is loaded only
while this user owns it and neither it nor its directory is writable by group or others.
Where it cannot be used — neither AVX-512F nor AVX2, no compiler, another OS, or
OMNIMTP_NATIVE_KERNELS=0 in the environment — `available()` is False and says why in `unavailable_reason()`;
callers then use MKL's packed SGEMM or `F.linear`.

    if available():
        packed = pack_weight(linear.weight)                     # [ceil(N/16), K, 16], once
        y = small_batch_linear(x, packed, linear.out_features)  # x [M, K] fp32 -> [M, N]

Results equal `F.linear` up to fp32 rounding (not bit for bit); each row's output depends only on that
row. Under torch.compile the call is one opaque op (`omnimtp::small_batch_linear`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

from omnimtp.runtime import tracing
from omnimtp.runtime.cache_dir import cache_root

_SOURCE = Path(__file__).with_name("small_batch_linear.c")
_ISA_FLAGS = {"AVX512": ["-mavx512f", "-mfma"], "AVX2": ["-mavx2", "-mfma"]}  # torch's CPU capability → build
PANEL = 16  # output columns per packed panel (one AVX-512 register, two AVX2 ones)
# (tile_rows, pass_rows) per build. 32 zmm registers hold 16 rows' accumulators. AVX2's 16 ymm registers hold 6
# rows' (2 a row) next to the 2 weight loads and the broadcast: a 16-row tile spilled to L1 and took 1.35x as long
# as tiles of 6, 5 and 5 rows on a 2-core AMD EPYC (8-row tiles: 1.25x); a pass of more rows reads the weights
# from memory once for all of them (17 rows: 8 % faster than passes of 16 and 1).
_TILING = {"AVX512": (16, 16), "AVX2": (6, 64)}

_unavailable: str | None = None  # why the kernel is off, once known
_LIBRARY = torch.library.Library("omnimtp", "FRAGMENT")  # the opaque operators (`opaque_op`)


def opaque_op(name: str, schema: str, kernel, fake):
    """`kernel` as the operator `torch.ops.omnimtp.<name>` (schema e.g. "(Tensor x, int n) -> Tensor"), which
    torch.compile calls as it is: one kernel for every backend (the mkl and oneDNN packed weights are opaque
    tensors of their own) and a fake one that gives the output's shape. A plain operator
    rather than `torch.library.custom_op`, whose extra dispatch cost about 12 us more a call inside a compiled
    graph (2-core AMD EPYC: 7 us above a direct call against 19), where the compiled code predictor calls its
    matmuls some 300 times a frame. No autograd: inference only. Returns the operator's overload."""
    _LIBRARY.define(name + schema)
    _LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"omnimtp::{name}", fake, lib=_LIBRARY)
    return getattr(torch.ops.omnimtp, name).default


def _cache_dir() -> Path:
    return cache_root() / "kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def isa() -> str | None:
    """The instruction set the kernel is built for on this CPU ("AVX512" or "AVX2"), or None."""
    capability = torch.backends.cpu.get_cpu_capability()
    return capability if capability in _ISA_FLAGS else None


def _flags() -> list[str]:
    return ["-O3", *_ISA_FLAGS[isa() or "AVX512"], "-fopenmp", "-fPIC", "-shared"]


def _build(compiler: str, source: Path = _SOURCE) -> Path:
    """Compile a kernel source next to this file (cached by source, flags and compiler) and return the shared
    library's path."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([source.read_text(), " ".join(_flags()), version]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"{source.stem}-{key}.so"
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_private(target.parent)
    if target.exists():
        _check_private(target)
        return target
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # concurrent builds: each writes its own file
        built = Path(tmp) / target.name
        result = subprocess.run([compiler, *_flags(), "-o", str(built), str(source)], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(built, target)  # atomic: a reader sees the whole library or none
    return target


def _check_private(path: Path) -> None:
    """Refuse a cached library (or its directory) that someone else could have written: loading a
    shared library runs its code in this process."""
    info = path.lstat()
    if info.st_uid != os.getuid():
        raise RuntimeError(f"{path} is owned by uid {info.st_uid}, not this user ({os.getuid()}); not loading it")
    if info.st_mode & 0o022:
        raise RuntimeError(f"{path} is writable by group or others (mode {info.st_mode & 0o777:o}); not loading it")


@functools.cache
def _library() -> ctypes.CDLL | None:
    global _unavailable
    _unavailable = None
    if os.environ.get("OMNIMTP_NATIVE_KERNELS", "1") == "0":
        _unavailable = "disabled by OMNIMTP_NATIVE_KERNELS=0"
        return None
    if not sys.platform.startswith("linux"):
        _unavailable = f"only built on Linux (this is {sys.platform})"
        return None
    if isa() is None:
        _unavailable = f"needs AVX-512F or AVX2 (this CPU: {torch.backends.cpu.get_cpu_capability()})"
        return None
    compiler = _compiler()
    if compiler is None:
        _unavailable = "no C compiler found (set CC)"
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        _unavailable = f"could not build {_SOURCE.name}: {exc}"
        return None
    fn = lib.omnimtp_small_batch_linear
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_int]
    fn.argtypes += [ctypes.c_int64, ctypes.c_int64]
    quantized = lib.omnimtp_quantized_linear
    quantized.restype = ctypes.c_int
    quantized.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int, ctypes.c_int64, ctypes.c_int]
    w4a8 = lib.omnimtp_w4a8_linear
    w4a8.restype = ctypes.c_int
    w4a8.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4 + [ctypes.c_int, ctypes.c_int]
    experts = lib.omnimtp_quantized_experts
    experts.restype = ctypes.c_int
    experts.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int, ctypes.c_int64]
    experts.argtypes += [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    w4a8_experts = lib.omnimtp_w4a8_experts
    w4a8_experts.restype = ctypes.c_int
    w4a8_experts.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 2
    w4a8_experts.argtypes += [ctypes.c_int64] * 3 + [ctypes.c_int, ctypes.c_int]
    lib.omnimtp_quantize_rows_u8.restype = None
    lib.omnimtp_quantize_rows_u8.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                             ctypes.c_void_p, ctypes.c_int]
    patches = lib.omnimtp_quantize_patches_u8
    patches.restype = ctypes.c_int
    patches.argtypes = [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_int64] * 12 + [ctypes.c_void_p] * 2 + [ctypes.c_int]
    lib.omnimtp_w4a8_has_vnni.restype = ctypes.c_int
    lib.omnimtp_w4a8_has_vnni.argtypes = []
    attention = lib.omnimtp_decode_attention
    attention.restype = ctypes.c_int
    attention.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 13 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    attention.argtypes += [ctypes.c_void_p]
    step = lib.omnimtp_w4a8_decode_step
    step.restype = ctypes.c_int
    step.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 7
    step.argtypes += [ctypes.c_float] + [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p]
    step.argtypes += [ctypes.c_int64] * 3 + [ctypes.c_void_p, ctypes.c_int64]
    step.argtypes += [ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return lib


def available() -> bool:
    """Whether the kernel runs here (builds it on the first call)."""
    return _library() is not None


def load_companion(source: Path, supported: str, requirement: str) -> tuple[ctypes.CDLL | None, str | None]:
    """Another kernel source of omnimtp, built and loaded as this one is (the same compiler, flags and cache) →
    (its library, None), or (None, why not): this kernel is unavailable, `source` does not build, or the library's
    `supported` function (no arguments, nonzero where the CPU runs its code) says no (why not: `requirement`)."""
    if not available():
        return None, unavailable_reason()
    try:
        lib = ctypes.CDLL(str(_build(_compiler(), source)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return None, f"could not build {source.name}: {exc}"
    check = getattr(lib, supported)
    check.restype = ctypes.c_int
    check.argtypes = []
    if not check():
        return None, requirement
    return lib, None


class Companion:
    """One companion kernel (`load_companion`), built and declared once, on first use: `library()` (None where it
    does not run), `available()`, `unavailable_reason()`. declare: sets its functions' argument and result types."""

    def __init__(self, source: Path, supported: str, requirement: str, declare):
        self._args = (source, supported, requirement)
        self._declare = declare
        self._lock = threading.Lock()
        self._loaded = False
        self._lib: ctypes.CDLL | None = None
        self._unavailable: str | None = None

    def library(self) -> ctypes.CDLL | None:
        if self._loaded:  # (every kernel call asks)
            return self._lib
        with self._lock:
            if not self._loaded:
                self._lib, self._unavailable = load_companion(*self._args)
                if self._lib is not None:
                    self._declare(self._lib)
                self._loaded = True
        return self._lib

    def available(self) -> bool:
        """Whether the kernel runs here (builds it on the first call)."""
        return self.library() is not None

    def unavailable_reason(self) -> str | None:
        """None when available(), else why not."""
        self.library()
        return self._unavailable


def build_id() -> str | None:
    """Which kernel runs here, None where none does: its build, its tiling and a digest of its source (what
    a step's measured time depends on), e.g. "AVX2 6x64 1f0c2a9b"."""
    if not available():
        return None
    tile_rows, pass_rows = tiling()
    return f"{isa()} {tile_rows}x{pass_rows} {hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:8]}"


def unavailable_reason() -> str | None:
    """None when available(), else why not."""
    available()
    return _unavailable


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """nn.Linear weight [N, K] fp32 → the kernel's layout [ceil(N/16), K, 16]: panels of 16 output
    columns, each stored input by input (zero padded). A new tensor; weight is not modified."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(
            f"weight must be a 2-D float32 CPU tensor, got {tuple(weight.shape)} {weight.dtype} on {weight.device}"
        )
    out_features, in_features = weight.shape
    padded = torch.nn.functional.pad(weight.detach(), (0, 0, 0, -out_features % PANEL))  # [N rounded up to 16, K]
    return padded.view(-1, PANEL, in_features).transpose(1, 2).contiguous()


def tiling() -> tuple[int, int]:
    """(tile_rows, pass_rows) the kernel runs with on this CPU (see `small_batch_linear`)."""
    return _TILING.get(isa(), _TILING["AVX512"])


def _library_and_output(x: torch.Tensor, out_features: int, what: str) -> tuple[ctypes.CDLL, torch.Tensor]:
    """The loaded kernel (RuntimeError naming `what` where it is not available) and the empty fp32 output
    [rows of x, out_features] a call writes."""
    lib = _library()
    if lib is None:
        raise RuntimeError(f"the {what} kernel is not available: {_unavailable}")
    return lib, torch.empty(x.shape[0], out_features, dtype=torch.float32)


def _run(x: torch.Tensor, packed: torch.Tensor, out_features: int, tile_rows: int, pass_rows: int) -> torch.Tensor:
    lib, out = _library_and_output(x, out_features, "small-batch linear")
    rows, in_features = x.shape
    if rows and out_features:
        status = lib.omnimtp_small_batch_linear(
            x.data_ptr(), packed.data_ptr(), out.data_ptr(), rows, in_features, out_features, torch.get_num_threads(),
            tile_rows, pass_rows,
        )
        if status != 0:
            raise MemoryError("small_batch_linear: out of memory")
    return out


def small_batch_linear(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, *, tiling: tuple[int, int] | None = None
) -> torch.Tensor:
    """x [M, K] fp32 @ W.T → [M, out_features], W packed by `pack_weight`. Needs `available()`
    (RuntimeError otherwise). x and packed are not modified.

    tiling: (tile_rows, pass_rows), None for this CPU's (`tiling()`): the rows run in passes of up to
    pass_rows rows, each streaming the weights from memory once, and a pass in tiles of up to tile_rows
    (1..16) rows, each tile's accumulators in registers (a tile re-reads the weights from cache). The
    values are the same for any tiling: what a benchmark varies."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"x must be a 2-D float32 CPU tensor, got {tuple(x.shape)} {x.dtype} on {x.device}")
    if (
        not packed.is_contiguous() or packed.dim() != 3 or packed.shape[2] != PANEL
        or packed.dtype != torch.float32 or packed.device.type != "cpu"
    ):
        raise ValueError(f"packed must come from pack_weight, got {tuple(packed.shape)} {packed.dtype}")
    if packed.shape[1] != x.shape[1]:
        raise ValueError(f"x has {x.shape[1]} features, the packed weight {packed.shape[1]}")
    if not PANEL * (packed.shape[0] - 1) < out_features <= PANEL * packed.shape[0]:
        raise ValueError(
            f"out_features={out_features} does not match the packed weight ({packed.shape[0]} panels of {PANEL})"
        )
    if tiling is not None:
        tile_rows, pass_rows = tiling
        if not (isinstance(tile_rows, int) and isinstance(pass_rows, int) and 1 <= tile_rows <= 16
                and tile_rows <= pass_rows):
            raise ValueError(f"tiling must be (tile_rows in 1..16, pass_rows >= tile_rows), got {tiling!r}")
        return _run(x.contiguous(), packed, out_features, tile_rows, pass_rows)
    return small_batch_linear_unchecked(x, packed, out_features)


def small_batch_linear_unchecked(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """`small_batch_linear` without the argument checks (~3 us a call), for callers that packed the
    weights themselves and pass fp32 CPU rows of the right width."""
    if tracing.is_compiling():
        return _small_batch_linear_op(x, packed, out_features)
    return _run(x.contiguous(), packed, out_features, *tiling())


_small_batch_linear_op = opaque_op(  # the kernel as one opaque op under torch.compile
    "small_batch_linear", "(Tensor x, Tensor packed, int out_features) -> Tensor",
    lambda x, packed, out_features: _run(x.contiguous(), packed, out_features, *tiling()),
    lambda x, packed, out_features: x.new_empty(x.shape[0], out_features),
)


# ---------------------------------------------------------------------------------------------
# Weight-only quantized weights (int8 per output channel; int4 per output channel and group of inputs)


def _max_abs(x: torch.Tensor) -> torch.Tensor:
    """max |x| over the last dimension, from its min and max (no |x| copy of the matrix); NaN where x has one."""
    low, high = x.aminmax(dim=-1)
    return torch.maximum(low.neg_(), high)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """nn.Linear weight [N, K] → (packed int8 [ceil(N/16), K, 16], scales [ceil(N/16) * 16] fp32): symmetric
    per-channel int8, W[n] ≈ scale[n] * q[n], q in -127..127. New tensors; weight is not modified."""
    w = weight.detach().float()
    scale = _max_abs(w).clamp(min=torch.finfo(torch.float32).tiny) / 127  # [N]
    q = w.div(scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)  # [N, K]
    pad = -w.shape[0] % PANEL
    packed = torch.nn.functional.pad(q, (0, 0, 0, pad)).view(-1, PANEL, w.shape[1]).transpose(1, 2).contiguous()
    return packed, torch.nn.functional.pad(scale, (0, pad))


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """nn.Linear weight [N, K] → (packed words [ceil(N/16), ceil(K/8), 16] int32, scales [ceil(N/16),
    K/group_size, 16] fp32): symmetric int4 per output channel and group of `group_size` consecutive inputs,
    W[n, k] ≈ scale[n, k // group_size] * q[n, k], q in -8..7 (scale = max|w| / 7). Word [p, w, c] holds column
    16p + c's q + 8 for inputs 8w..8w+7, input 8w + j in bits 4j..4j+3 (inputs past K: 8). K must be a multiple of
    group_size. New tensors; weight is not modified."""
    w = weight.detach().float()
    out_features, in_features = w.shape
    groups = w.view(out_features, in_features // group_size, group_size)
    scale = _max_abs(groups).clamp(min=torch.finfo(torch.float32).tiny) / 7  # [N, G]
    q = groups.div(scale[..., None]).round_().clamp_(-8, 7).add_(8).to(torch.uint8)  # [N, G, g]: q + 8 in 0..15
    pad = -out_features % PANEL
    biased = torch.nn.functional.pad(
        q.view(out_features, in_features), (0, -in_features % 8, 0, pad), value=8
    )  # [N', K'] with K' a multiple of 8
    pairs = biased.view(biased.shape[0], -1, 2)  # inputs 2i and 2i + 1 → one byte, the first in its low bits
    nibble_pairs = pairs[..., 0] | (pairs[..., 1] << 4)  # [N', K'/2] uint8
    # four bytes → one 32-bit word, the first byte lowest (x86 is little-endian): input 8w + j in bits 4j..4j+3
    words = nibble_pairs.contiguous().view(torch.int32)  # [N', K'/8]
    packed = words.view(-1, PANEL, words.shape[1]).transpose(1, 2).contiguous()  # [P, K'/8, 16]
    scales = torch.nn.functional.pad(scale, (0, 0, 0, pad)).view(-1, PANEL, scale.shape[1]).transpose(1, 2)
    return packed, scales.contiguous()


def unpack_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """`quantize_int4`'s words [P, ceil(K/8), 16] → q [16P, K] int64 in -8..7."""
    nibbles = (packed.to(torch.int64)[..., None] >> (4 * torch.arange(8))) & 0x0F  # [P, K'/8, 16, 8]
    q = nibbles.permute(0, 2, 1, 3).reshape(packed.shape[0] * PANEL, -1)  # [16P, K']
    return q[:, :in_features] - 8


def quantized_linear(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, out_features: int, group_size: int | None
) -> torch.Tensor:
    """x [M, K] fp32 @ dequantized W.T → [M, out_features], W from `quantize_int8` (group_size None) or
    `quantize_int4`. Needs `available()`; no argument checks (callers pass what they quantized)."""
    if tracing.is_compiling():
        return _quantized_linear_op(x, packed, scales, out_features, group_size or 0)
    return _run_quantized(x.contiguous(), packed, scales, out_features, group_size or 0)


def _run_quantized(x, packed, scales, out_features: int, group_size: int) -> torch.Tensor:
    lib, out = _library_and_output(x, out_features, "quantized linear")
    rows, in_features = x.shape
    if rows and out_features:
        status = lib.omnimtp_quantized_linear(
            x.data_ptr(), packed.data_ptr(), scales.data_ptr(), out.data_ptr(), rows, in_features, out_features,
            4 if group_size else 8, group_size, torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError("quantized_linear: out of memory")
    return out


_QUANTIZED_SCHEMA = "(Tensor x, Tensor packed, Tensor scales, int out_features, int group_size) -> Tensor"
_quantized_linear_op = opaque_op(  # the quantized kernel as one opaque op under torch.compile
    "quantized_linear", _QUANTIZED_SCHEMA,
    lambda x, packed, scales, out_features, group_size: _run_quantized(
        x.contiguous(), packed, scales, out_features, group_size),
    lambda x, packed, scales, out_features, group_size: x.new_empty(x.shape[0], out_features),
)


# ---------------------------------------------------------------------------------------------
# int4 weights with int8 activations ("w4a8": `quantize_int4`'s weights; the activations quantized per row and
# group of inputs as each call starts, the inner sums exact integers)

W4A8_ISAS = ("AVX512-VNNI", "AVX2")


def w4a8_isa() -> str | None:
    """Which instructions `w4a8_linear` runs here: "AVX512-VNNI" where the CPU has them, else "AVX2"; None
    without the kernel. Both give the same bits."""
    lib = _library()
    if lib is None:
        return None
    return W4A8_ISAS[0] if lib.omnimtp_w4a8_has_vnni() else W4A8_ISAS[1]


def quantize_activations_int8(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What `w4a8_linear` does to its input, in torch ops: x [M, K] fp32 → (xq [M, K] fp32 holding integers in
    -127..127, scales [M, K / group_size]): per row and group, scale = max|x| / 127 and xq = round(x * (127 /
    max|x|)), ties to even; an all-zero group gives zeros and scale 0, a group with a NaN or an infinity scale
    NaN. x is not modified."""
    rows, in_features = x.shape
    groups = x.float().view(rows, in_features // group_size, group_size)
    amax = groups.abs().amax(-1)  # NaN where a NaN is
    finite = torch.isfinite(amax) & (amax > 0)
    inv = torch.where(finite, 127.0 / torch.where(finite, amax, 1.0), 0.0)
    xq = torch.round(groups * inv[..., None]).clamp(-127, 127)
    scales = torch.where(finite | (amax == 0), amax / 127.0, float("nan"))
    return xq.view(rows, in_features), scales


def quantize_rows_u8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 → (q [M, K] uint8, scales [M, 1] fp32): each row quantized to int8 over all its inputs as
    `quantize_activations_int8(x, K)` quantizes it, plus 128 (oneDNN's u8 activations with zero point 128; an
    all-zero row or one with a NaN or an infinity: 128s, scale 0 or NaN). One pass a row, rows over the threads.
    Needs `available()`; x is not modified."""
    lib = _library()
    if lib is None:
        raise RuntimeError(f"the row quantizer is not available: {_unavailable}")
    x = x.contiguous()
    rows, in_features = x.shape
    q = torch.empty(rows, in_features, dtype=torch.uint8)
    scales = torch.empty(rows, 1, dtype=torch.float32)
    if rows and in_features:
        lib.omnimtp_quantize_rows_u8(x.data_ptr(), rows, in_features, q.data_ptr(), scales.data_ptr(),
                                     torch.get_num_threads())
    return q, scales


def quantize_patches_u8(
    x: torch.Tensor, kernel_size: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int],
    row0: int = 0, num_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, H, W, C] channels last (fp32 or bf16) → rows row0..row0 + num_rows - 1 (default: to the last) of its
    patch matrix for a convolution of `kernel_size` (kh, kw), `stride` and `padding` (zeros outside x), each row
    quantized as `quantize_rows_u8` quantizes the rows of the unfolded fp32 matrix (the same values): (q [n, kh *
    kw * C] uint8, scales [n, 1] fp32). Row (b, ho, wo), in that order, holds x[b, ho * sh - ph + i, wo * sw - pw +
    j, :] for i < kh, then j < kw: a convolution weight [O, C, kh, kw] permuted to [O, kh, kw, C] multiplies it. Only
    the requested rows are made (a caller bounds its memory by taking them in blocks). Needs `available()`; x is not
    modified."""
    lib = _library()
    if lib is None:
        raise RuntimeError(f"the row quantizer is not available: {_unavailable}")
    if x.dim() != 4 or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"x must be [B, H, W, C] fp32 or bf16, got {tuple(x.shape)} {x.dtype}")
    x = x.contiguous()
    batch, height, width, channels = x.shape
    (kh, kw), (sh, sw), (ph, pw) = kernel_size, stride, padding
    out_rows = batch * ((height + 2 * ph - kh) // sh + 1) * ((width + 2 * pw - kw) // sw + 1)
    num_rows = out_rows - row0 if num_rows is None else num_rows
    if not 0 <= row0 <= row0 + num_rows <= out_rows:
        raise ValueError(f"rows {row0}..{row0 + num_rows - 1} are outside the {out_rows} rows of the patch matrix")
    q = torch.empty(num_rows, kh * kw * channels, dtype=torch.uint8)
    scales = torch.empty(num_rows, 1, dtype=torch.float32)
    if num_rows and channels:
        status = lib.omnimtp_quantize_patches_u8(
            x.data_ptr(), int(x.dtype == torch.bfloat16), batch, height, width, channels, kh, kw, sh, sw, ph, pw,
            row0, num_rows, q.data_ptr(), scales.data_ptr(), torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError("omnimtp_quantize_patches_u8: out of memory")
    return q, scales


def w4a8_linear(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, out_features: int, group_size: int,
    *, isa: str | None = None,
) -> torch.Tensor:
    """x [M, K] fp32 @ W.T → [M, out_features] with W from `quantize_int4` and x quantized to int8 per row and
    group of `group_size` inputs (`quantize_activations_int8`): sum over groups of (weight scale × activation
    scale) × the exact integer dot product of the group. isa: None for this CPU's best (`w4a8_isa()`), or one of
    W4A8_ISAS (ValueError where the CPU lacks it): every choice gives the same bits, and a row's values do not
    depend on the other rows. Needs `available()`; ValueError for a group_size that does not divide K in whole
    words of 8 inputs (one group of all K may be any width); no other argument checks."""
    if isa is not None and isa not in W4A8_ISAS:
        raise ValueError(f"isa must be None or one of {W4A8_ISAS}, got {isa!r}")
    if tracing.is_compiling():
        return _w4a8_linear_op(x, packed, scales, out_features, group_size)
    return _run_w4a8(x.contiguous(), packed, scales, out_features, group_size, isa)


def _run_w4a8(x, packed, scales, out_features: int, group_size: int, isa: str | None = None) -> torch.Tensor:
    lib, out = _library_and_output(x, out_features, "quantized linear")
    rows, in_features = x.shape
    if rows and out_features:
        choice = -1 if isa is None else int(isa == W4A8_ISAS[0])
        status = lib.omnimtp_w4a8_linear(
            x.data_ptr(), packed.data_ptr(), scales.data_ptr(), out.data_ptr(), rows, in_features, out_features,
            group_size, torch.get_num_threads(), choice,
        )
        if status == -2:
            raise ValueError(f"isa={isa!r}: this CPU lacks it (it runs {w4a8_isa()})")
        if status == -3:
            raise ValueError(f"group_size={group_size} must divide {in_features} inputs in words of 8 (or be all)")
        if status != 0:
            raise MemoryError("w4a8_linear: out of memory")
    return out


_w4a8_linear_op = opaque_op(  # the w4a8 kernel as one opaque op under torch.compile
    "w4a8_linear", _QUANTIZED_SCHEMA,
    lambda x, packed, scales, out_features, group_size: _run_w4a8(
        x.contiguous(), packed, scales, out_features, group_size),
    lambda x, packed, scales, out_features, group_size: x.new_empty(x.shape[0], out_features),
)


# ---------------------------------------------------------------------------------------------
# Routed experts: every expert's matrix quantized alike and stacked, the rows of one call grouped by expert


def quantized_experts(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, out_features: int, group_size: int | None,
    int8_activations: bool, experts: torch.Tensor, offsets: torch.Tensor,
) -> torch.Tensor:
    """Rows x [T, K] fp32, grouped by expert, through their experts' matrices in one call → [T, out_features]:
    rows offsets[i]..offsets[i + 1] - 1 (offsets int64 [G + 1], 0 to T, non-decreasing) by expert experts[i]
    (int64 [G], each in 0..E-1, any order). packed, scales: every expert's `quantize_int8` / `quantize_int4` form
    stacked, [E, ...] (int8_activations: `w4a8_linear` on the int4 weights). Work is split over the threads by
    (expert, panel of columns), so one token's experts run on every core; a row's values are those of the
    single-matrix kernel on its expert alone (`quantized_linear` / `w4a8_linear`), bit for bit. Needs
    `available()`; no argument checks (`omnimtp.runtime.ops.expert_linear` calls it)."""
    lib, out = _library_and_output(x, out_features, "quantized experts")
    x = x.contiguous()
    rows, in_features = x.shape
    if rows and out_features and experts.numel():
        threads = torch.get_num_threads()
        if int8_activations:
            status = lib.omnimtp_w4a8_experts(
                x.data_ptr(), packed.data_ptr(), scales.data_ptr(), out.data_ptr(), rows, in_features, out_features,
                group_size, experts.data_ptr(), offsets.data_ptr(), experts.numel(), packed.stride(0),
                scales.stride(0), threads, -1,
            )
            if status == -3:
                raise ValueError(f"group_size={group_size} must divide {in_features} inputs in words of 8 (or be all)")
        else:
            status = lib.omnimtp_quantized_experts(
                x.data_ptr(), packed.data_ptr(), scales.data_ptr(), out.data_ptr(), rows, in_features, out_features,
                4 if group_size else 8, group_size or 0, experts.data_ptr(), offsets.data_ptr(), experts.numel(),
                packed.stride(0) * packed.element_size(), scales.stride(0), threads,
            )
        if status != 0:
            raise MemoryError("quantized_experts: out of memory")
    return out


# ---------------------------------------------------------------------------------------------
# Attention of one query position (a batch-1 decode step)

DECODE_ATTENTION_MAX_HEAD_DIM = 256
DECODE_ATTENTION_MAX_GROUP = 16
DECODE_ATTENTION_DTYPES = (torch.float32, torch.bfloat16)  # query, keys, values and output alike


def decode_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, mask: torch.Tensor | None = None,
    kv_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped-query attention of one query position a row: query [Nq, D] (one row) or [R, Nq, D]; keys and
    values [R, Nkv, S, D] CPU views whose rows are contiguous (a KV cache's, `omnimtp.runtime.kv_cache`), all
    fp32 or all bf16 (DECODE_ATTENTION_DTYPES); mask: None (every key visible) or bool [R or 1, S] (True =
    visible) → [Nq * D] (one row) or [R, Nq * D] in that dtype, query head h reading key head h // (Nq / Nkv).
    Scores, softmax and sums in fp32: SDPA's values up to fp32 rounding; bf16 values are widened exactly and each
    output rounded to bf16 once, so a bf16 call gives fp32 SDPA's values on the widened tensors, rounded (SDPA's
    bf16 CPU kernel also rounds its probabilities to bf16: within a bf16 step or two of it). A masked key is left
    out, not weighted by zero, so a row's output is bit for bit the same alone (its visible keys, no mask) as in
    any batch. kv_rows: None, or int64 [R] the row of keys and values each query row reads (keys and values then
    [B, Nkv, S, D], any B: several positions of one sequence attend to its cache slot where it lies, no copy).
    Needs `available()`, one of those dtypes for all three, D up to DECODE_ATTENTION_MAX_HEAD_DIM and
    Nq / Nkv up to DECODE_ATTENTION_MAX_GROUP (ValueError otherwise); no gradients, no other argument checks
    (`omnimtp.runtime.ops.attention` calls it where it applies)."""
    if not (query.dtype == keys.dtype == values.dtype and query.dtype in DECODE_ATTENTION_DTYPES):
        raise ValueError(f"decode_attention: query, keys and values must all be one of {DECODE_ATTENTION_DTYPES}, "
                         f"got {query.dtype}, {keys.dtype}, {values.dtype}")
    lib = _library()
    if lib is None:
        raise RuntimeError(f"the decode attention kernel is not available: {_unavailable}")
    rows = (query if query.dim() == 3 else query[None]).contiguous()  # [R, Nq, D]
    num_rows, num_heads, head_dim = rows.shape
    _, num_kv_heads, length, _ = keys.shape
    if mask is not None:
        mask = mask.contiguous()
    if kv_rows is not None:
        kv_rows = kv_rows.to(torch.int64).contiguous()
        if kv_rows.shape != (num_rows,) or (num_rows and not 0 <= int(kv_rows.min()) <= int(kv_rows.max()) < len(keys)):
            raise ValueError(f"decode_attention: kv_rows must be [{num_rows}] rows of keys [{len(keys)}, ...], "
                             f"got {tuple(kv_rows.shape)}")
    out = torch.empty(num_rows, num_heads * head_dim, dtype=rows.dtype)
    status = lib.omnimtp_decode_attention(
        rows.data_ptr(), keys.data_ptr(), values.data_ptr(), None if mask is None else mask.data_ptr(),
        out.data_ptr(), num_rows, num_heads, num_kv_heads, length, head_dim, rows.stride(0),
        keys.stride(0) if keys.shape[0] > 1 else 0, keys.stride(1), keys.stride(2),
        values.stride(0) if values.shape[0] > 1 else 0, values.stride(1), values.stride(2),
        0 if mask is None or mask.shape[0] == 1 else mask.stride(0), scale, torch.get_num_threads(),
        int(rows.dtype == torch.bfloat16), None if kv_rows is None else kv_rows.data_ptr(),
    )
    if status == -2:
        raise ValueError(f"decode_attention: head_dim {head_dim} (at most {DECODE_ATTENTION_MAX_HEAD_DIM}) or "
                         f"{num_heads} query heads over {num_kv_heads} key heads (a group of at most "
                         f"{DECODE_ATTENTION_MAX_GROUP}) out of range")
    if status != 0:
        raise MemoryError("decode_attention: out of memory")
    return out if query.dim() == 3 else out[0]


# ---------------------------------------------------------------------------------------------
# A w4a8 decoder's decode step, every layer in one call

W4A8_STEP_WEIGHTS = 13  # pointers a layer in `w4a8_decode_step`'s weights table


def w4a8_decode_step(
    x: torch.Tensor, weights: ctypes.Array, kv: ctypes.Array, num_layers: int, shape: tuple[int, int, int, int],
    groups: tuple[int, int, int], eps: float, cos: torch.Tensor, signed_sin: torch.Tensor, slots: ctypes.Array,
    columns: ctypes.Array, num_keys: int, kv_strides: tuple[int, int, int], mask: torch.Tensor | None, scale: float,
    *, row_keys: ctypes.Array | None = None, isa: str | None = None, kv_bf16: bool = False,
) -> None:
    """Every layer of a dense w4a8 decoder on rows x [R, H] fp32 (contiguous; overwritten by the last layer's output,
    before the final norm), one new position a row, in one call (the C kernel's `omnimtp_w4a8_decode_step`: what
    each stage computes). weights: W4A8_STEP_WEIGHTS addresses a layer (input_norm, qkv words, scales, bias or 0,
    qk_norm [Nq + Nkv, D] or 0, o words, scales, bias or 0, post_norm, gate_up words, scales, down words, scales);
    kv: the addresses of each layer's keys and values [B, Nkv, S, D] (kv_strides: slot, head and column strides in
    elements); shape: (Nq, Nkv, D, I); groups: the w4a8 group sizes of the matrices whose inputs are H, Nq * D and I
    wide; cos, signed_sin [R, D] fp32 contiguous; row r writes slot slots[r], column columns[r], and attends to
    columns 0..n-1 (n: row_keys[r], or num_keys; those True in mask [R or 1, num_keys] bool, when given); every
    row's key and value are written before any row attends (a causal block of one sequence may come as rows of
    one slot). kv_bf16: the cache is bf16 (new keys and values rounded to it, read widened), else fp32. isa as
    `w4a8_linear`'s. Needs
    `available()`; the addresses and shapes are not checked (`omnimtp.runtime.w4a8_step` makes them)."""
    if isa is not None and isa not in W4A8_ISAS:
        raise ValueError(f"isa must be None or one of {W4A8_ISAS}, got {isa!r}")
    lib = _library()
    if lib is None:
        raise RuntimeError(f"the w4a8 decode step kernel is not available: {_unavailable}")
    num_rows, hidden = x.shape
    num_heads, num_kv_heads, head_dim, intermediate = shape
    mask_stride = 0 if mask is None or mask.shape[0] == 1 else mask.stride(0)
    status = lib.omnimtp_w4a8_decode_step(
        x.data_ptr(), num_rows, hidden, num_layers, weights, kv, num_heads, num_kv_heads, head_dim, intermediate,
        *groups, eps, cos.data_ptr(), signed_sin.data_ptr(), slots, columns, num_keys, row_keys, *kv_strides,
        None if mask is None else mask.data_ptr(), mask_stride, scale, torch.get_num_threads(),
        -1 if isa is None else int(isa == W4A8_ISAS[0]), int(kv_bf16),
    )
    if status == -2:
        raise ValueError(f"w4a8_decode_step: head_dim {head_dim} (even, at most {DECODE_ATTENTION_MAX_HEAD_DIM}), "
                         f"{num_heads} query heads over {num_kv_heads} key heads (a group of at most "
                         f"{DECODE_ATTENTION_MAX_GROUP}) or isa={isa!r} out of range")
    if status == -3:
        raise ValueError(f"w4a8_decode_step: group sizes {groups} must divide their inputs in words of 8 (or be all)")
    if status != 0:
        raise MemoryError("w4a8_decode_step: out of memory")
