"""A cloned voice for Qwen3-TTS Base: what a reference recording contributes to a request, computed once.

A `Voice` holds the speaker embedding (the ECAPA-TDNN x-vector of the recording), and for in-context (ICL)
cloning also the recording's codes from the 12 Hz speech tokenizer (`ref_codes`, `[num_code_groups, T]`) and
the token ids of its transcript (`ref_text_ids`: the ids between `<|im_start|>assistant\n` and `<|im_end|>\n` of
the transcript's template, as the reference slices them). Without codes and text ids it is an x-vector-only
voice. `OmniPipeline.create_voice` makes one; `speech(..., voice=voice)` speaks with it.

It saves to one safetensors file (tensors, plus its metadata as JSON in the header; no pickle) and to bytes of
the same format, which is what the server's voice store keeps.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load, load_file, save, save_file

FORMAT = "omnimtp.voice/1"
MODES = ("x_vector", "icl")


@dataclass(frozen=True)
class Voice:
    """speaker_embedding: float32 `[D]`; ref_codes: int64 `[G, T]` or None; ref_text_ids: int64 `[N]` or None
    (both or neither); ref_text: the transcript as given, or None; seconds: the recording's length (0 when
    the parts were passed precomputed); created: Unix time; info: free-form string metadata (model size,
    consent record...). The tensors are copies: a Voice never shares storage with what its caller passed."""

    speaker_embedding: torch.Tensor
    ref_codes: torch.Tensor | None = None
    ref_text_ids: torch.Tensor | None = None
    ref_text: str | None = None
    seconds: float = 0.0
    created: float = field(default_factory=time.time)
    info: dict = field(default_factory=dict)

    def __post_init__(self):
        emb = torch.as_tensor(self.speaker_embedding)
        if emb.dim() != 1 or emb.numel() == 0 or not emb.is_floating_point():
            raise ValueError(f"speaker_embedding: a float vector [D], got shape {tuple(emb.shape)} {emb.dtype}")
        if not torch.isfinite(emb).all():
            raise ValueError("speaker_embedding: has non-finite values")
        object.__setattr__(self, "speaker_embedding", emb.detach().to("cpu", torch.float32).clone())
        if (self.ref_codes is None) != (self.ref_text_ids is None):
            raise ValueError("ref_codes: an in-context voice needs both ref_codes and ref_text_ids (or neither)")
        if self.ref_codes is not None:
            codes = torch.as_tensor(self.ref_codes)
            if codes.dim() != 2 or codes.shape[1] == 0 or codes.is_floating_point() or codes.dtype == torch.bool:
                raise ValueError(f"ref_codes: integer codes [num_code_groups, T], got shape {tuple(codes.shape)} "
                                 f"{codes.dtype}")
            if (codes < 0).any():
                raise ValueError("ref_codes: codes are non-negative")
            ids = torch.as_tensor(self.ref_text_ids)
            if ids.dim() != 1 or ids.numel() == 0 or ids.is_floating_point() or ids.dtype == torch.bool:
                raise ValueError(f"ref_text_ids: integer token ids [N], got shape {tuple(ids.shape)} {ids.dtype}")
            if (ids < 0).any():
                raise ValueError("ref_text_ids: token ids are non-negative")
            object.__setattr__(self, "ref_codes", codes.detach().to("cpu", torch.int64).clone())
            object.__setattr__(self, "ref_text_ids", ids.detach().to("cpu", torch.int64).clone())
        if not isinstance(self.info, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                       for k, v in self.info.items()):
            raise ValueError("info: a dict of str to str")
        object.__setattr__(self, "info", dict(self.info))
        object.__setattr__(self, "seconds", float(self.seconds))
        object.__setattr__(self, "created", float(self.created))

    @property
    def mode(self) -> str:
        """"icl" (embedding + reference codes + transcript) or "x_vector" (the embedding alone)."""
        return "icl" if self.ref_codes is not None else "x_vector"

    def x_vector_only(self) -> Voice:
        """The same voice without its in-context part."""
        return Voice(self.speaker_embedding, seconds=self.seconds, created=self.created, info=self.info)

    # -- files and bytes ---------------------------------------------------------------------------------------

    def _tensors_and_meta(self) -> tuple[dict, dict]:
        tensors = {"speaker_embedding": self.speaker_embedding}
        if self.ref_codes is not None:
            tensors["ref_codes"] = self.ref_codes.contiguous()
            tensors["ref_text_ids"] = self.ref_text_ids.contiguous()
        meta = {"format": FORMAT, "mode": self.mode, "seconds": repr(self.seconds), "created": repr(self.created),
                "ref_text": json.dumps(self.ref_text), "info": json.dumps(self.info, sort_keys=True)}
        return tensors, meta

    def save(self, path) -> None:
        """Write the voice to a safetensors file at `path`."""
        tensors, meta = self._tensors_and_meta()
        save_file(tensors, str(path), metadata=meta)

    def to_bytes(self) -> bytes:
        tensors, meta = self._tensors_and_meta()
        return save(tensors, metadata=meta)

    @classmethod
    def load(cls, path) -> Voice:
        """Read a voice written by `save`; ValueError naming the path when it is not one."""
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
            tensors = load_file(str(path))
        except FileNotFoundError:
            raise ValueError(f"voice: no such file {path}") from None
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"voice: {path} is not a voice file ({exc})") from None
        return cls._from_parts(tensors, meta, str(path))

    @classmethod
    def from_bytes(cls, data: bytes) -> Voice:
        try:
            tensors = load(data)
            meta = _header_metadata(data)
        except (SafetensorError, ValueError) as exc:  # json's errors are ValueErrors
            raise ValueError(f"voice: not a voice ({exc})") from None
        return cls._from_parts(tensors, meta, "bytes")

    @classmethod
    def _from_parts(cls, tensors: dict, meta: dict, where: str) -> Voice:
        if meta.get("format") != FORMAT or "speaker_embedding" not in tensors:
            raise ValueError(f"voice: {where} is not an omnimtp voice (format {meta.get('format')!r})")
        try:
            return cls(tensors["speaker_embedding"], tensors.get("ref_codes"), tensors.get("ref_text_ids"),
                       ref_text=json.loads(meta.get("ref_text", "null")), seconds=float(meta.get("seconds", 0)),
                       created=float(meta.get("created", 0)), info=json.loads(meta.get("info", "{}")))
        except (TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"voice: {where} has bad metadata ({exc})") from None


def _header_metadata(data: bytes) -> dict:
    """The `__metadata__` of a safetensors buffer (8-byte little-endian header length, then JSON)."""
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]).get("__metadata__") or {}
