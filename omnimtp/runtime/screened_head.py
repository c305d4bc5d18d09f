"""A quantized decoder's greedy tokens from its int8 head at about an int4 head's read.

A decode step of a small quantized decoder reads its output matrix every token: Qwen3-ASR-0.6B's head is
151936 x 1024, 156 MB in int8 against 220 MB for all 28 of its w4a8 layers. A greedy step needs the head's
argmax only, not its logits: `ScreenedHead.greedy` scores every row of the vocabulary with an int4 copy of the head
("w4a8", half the bytes), keeps the `candidates` best, and computes those rows exactly as the int8 head computes
them (the same kernel on the same bytes: each column's sum does not depend on which columns run with it), so the
token is the int8 head's argmax whenever that token is among the int4 copy's best `candidates` — the int4 error
would have to move it below that many others. That is likely, not certain: on random weights at the released
width, whose logits are far flatter than a trained model's (the int4 error 12 % of their spread), 64 candidates
kept the int8 head's token on 20000 of 20000 rows and 16 on 19994 (`benchmarks/decode_step_parts.py` counts it;
`tests/test_screened_head.py` checks a seeded set). Ties go to the lowest id, as the full argmax's. Callers that
need logits (sampling, log-probabilities) use the int8 head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omnimtp.runtime.kernels import small_batch_linear
from omnimtp.runtime.ops import QuantizedWeight, linear, quantize_weight

SCREEN_CANDIDATES = 64  # vocabulary rows rescored exactly per row
PANEL = small_batch_linear.PANEL  # output columns per panel of an "int8" matrix


@dataclass(frozen=True)
class ScreenedHead:
    """An "int8" head (`exact`, `quantize_weight(lm_head, "int8")`) and its "w4a8" copy (`screen`)."""

    exact: QuantizedWeight
    screen: QuantizedWeight
    candidates: int = SCREEN_CANDIDATES

    @classmethod
    def from_weight(cls, lm_head: torch.Tensor, exact: QuantizedWeight | None = None,
                    candidates: int | None = None) -> ScreenedHead:
        """lm_head [V, H] → its screened form; exact: the head's "int8" form where the caller holds it already;
        candidates: rows rescored (default SCREEN_CANDIDATES, or V where it has fewer). ValueError naming
        `candidates` unless 1 <= candidates <= V, or `exact` when it is not an "int8" form of a [V, H] matrix."""
        num_rows = lm_head.shape[0]
        if candidates is None:
            candidates = min(SCREEN_CANDIDATES, num_rows)
        if isinstance(candidates, bool) or not isinstance(candidates, int) or not 1 <= candidates <= num_rows:
            raise ValueError(f"candidates must be an int in [1, {num_rows}], got {candidates!r}")
        if exact is None:
            exact = quantize_weight(lm_head, "int8")
        elif exact.mode != "int8" or exact.out_features != num_rows or exact.packed.shape[1] != lm_head.shape[1]:
            raise ValueError(f"exact must be the head's \"int8\" form [{num_rows}, {lm_head.shape[1]}], got a "
                             f"{exact.mode!r} form of {exact.out_features} rows")
        return cls(exact, quantize_weight(lm_head, "w4a8"), candidates)

    def greedy(self, x: torch.Tensor) -> torch.Tensor:
        """x [R, H] (the final norm's rows) → the int8 head's argmax per row, long [R] (see the module)."""
        rows = x.float().contiguous()
        scores = linear(rows, None, packed=self.screen)  # [R, V]: every row of the vocabulary, in int4
        top = scores.topk(self.candidates, dim=-1, sorted=False).indices.sort(dim=-1).values  # [R, C] ascending
        ids = top.reshape(-1)  # [R * C]
        exact = self.exact
        columns = exact.packed[ids // PANEL, :, ids % PANEL]  # [R * C, H] int8: the candidates' rows
        pad = -columns.shape[0] % PANEL
        packed = torch.nn.functional.pad(columns, (0, 0, 0, pad)).view(-1, PANEL, columns.shape[1])
        packed = packed.transpose(1, 2).contiguous()  # [ceil(R * C / 16), H, 16]: the int8 panel layout
        scales = torch.nn.functional.pad(exact.scales[ids], (0, pad))
        logits = small_batch_linear.quantized_linear(rows, packed, scales, ids.shape[0], None)  # [R, R * C]
        num_rows, count = top.shape
        own = logits.view(num_rows, num_rows, count)[torch.arange(num_rows), torch.arange(num_rows)]  # [R, C]
        return top.gather(1, own.argmax(dim=-1, keepdim=True))[:, 0]
