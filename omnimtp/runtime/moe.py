"""Mixture-of-experts: the routers and the expert dispatch every MoE decoder uses.

    top_weights, top_experts = route(router, x, router_logits)        # [N, k] each
    outputs = expert_outputs(x, top_experts, gate_up, down)           # [N*k, H], only picked experts
    routed = combine(outputs, top_weights, x.dtype)                   # [N, H], rank-order sums
    outputs = quantized_expert_outputs(x, top_experts, gate_up_q, down_q)   # quantized: one call per matmul

Routers, exactly as transformers computes them:
- `SoftmaxTopK` (Qwen3-MoE / Qwen3-Omni `TopKRouter`): softmax of the logits in fp32, top-k, optional
  renormalisation, weights cast back to the logits' dtype;
- `GroupLimitedSigmoid` (glm4_moe's `Glm4MoeTopkRouter`): sigmoid scores in fp32, `e_score_correction_bias`
  for the choice only, the best `top_k_groups` groups (by the sum of their two best scores), top-k among
  their experts, optional renormalisation, `routed_scaling_factor`; weights stay fp32.
Experts are transformers' fused tensors (gate_up [E, 2I, H], down [E, H, I], SiLU-gated) summed over each
token's top-k in rank order, as its default `grouped_mm` path; or those tensors quantized (`ops.quantize_experts`),
where each of the two matmuls is one kernel call for every picked expert (`quantized_expert_outputs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from omnimtp.runtime.ops import QuantizedWeight, expert_linear, linear


@dataclass(frozen=True)
class SoftmaxTopK:
    """Qwen3-MoE's router; its logits come from the caller's matmul (router rows, in the model dtype)."""

    num_experts: int
    top_k: int
    norm_topk_prob: bool


@dataclass(frozen=True)
class GroupLimitedSigmoid:
    """glm4_moe's router (weights as transformers keeps them: fp32)."""

    weight: torch.Tensor  # [E, H] fp32
    correction_bias: torch.Tensor  # [E] fp32
    num_groups: int
    top_k_groups: int
    top_k: int
    norm_topk_prob: bool
    routed_scaling_factor: float

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]


Router = SoftmaxTopK | GroupLimitedSigmoid


def route(
    router: Router, x: torch.Tensor, router_logits: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens x [N, H] → (top_weights [N, k], top_experts [N, k]). SoftmaxTopK takes the router's logits
    [N, E] (computed by the caller, often fused with another matmul; one token may come as [E] → [k]);
    GroupLimitedSigmoid computes its own fp32 logits x @ weight.T, or takes them from the caller likewise."""
    if isinstance(router, SoftmaxTopK):
        probs = router_logits.softmax(dim=-1, dtype=torch.float)  # [N, E]
        top_weights, top_experts = torch.topk(probs, router.top_k, dim=-1)  # [N, k]
        if router.norm_topk_prob:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        return top_weights.to(router_logits.dtype), top_experts
    if x.dim() == 1:  # one token
        top_weights, top_experts = route(router, x[None], None if router_logits is None else router_logits[None])
        return top_weights[0], top_experts[0]
    num_tokens, num_experts = x.shape[0], router.num_experts
    if router_logits is None:
        router_logits = F.linear(x.float(), router.weight)
    scores = router_logits.sigmoid()  # [N, E]
    scores_for_choice = scores + router.correction_bias
    if router.top_k_groups < router.num_groups:  # else every group is kept: the mask below would keep all
        group_scores = scores_for_choice.view(
            -1, router.num_groups, num_experts // router.num_groups
        ).topk(2, dim=-1)[0]
        group_idx = torch.topk(group_scores.sum(dim=-1), k=router.top_k_groups, dim=-1, sorted=False)[1]  # [N, G']
        group_mask = torch.zeros(num_tokens, router.num_groups, device=x.device).scatter_(1, group_idx, 1)
        score_mask = group_mask[:, :, None].expand(-1, -1, num_experts // router.num_groups).reshape(-1, num_experts)
        scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
    top_experts = torch.topk(scores_for_choice, k=router.top_k, dim=-1, sorted=False)[1]  # [N, k]
    top_weights = scores.gather(1, top_experts)
    if router.norm_topk_prob:
        top_weights = top_weights / (top_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return top_weights * router.routed_scaling_factor, top_experts  # [N, k] fp32


def routes_every_expert(router: Router | None) -> bool:
    """Whether a glm4_moe router always picks every expert (top_k = number of experts, every group kept):
    then only the routing weights depend on the token (see `every_expert`)."""
    return (
        isinstance(router, GroupLimitedSigmoid) and router.top_k == router.num_experts
        and router.top_k_groups == router.num_groups
    )


def every_expert(
    router: GroupLimitedSigmoid, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """`routed_experts` for a router that picks every expert (`routes_every_expert`), as one SiLU-gated MLP:
    x [N, H] (or one token [H]) → same shape; gate_up [E * 2I, H] every expert's [gate; up] rows, down
    [H, E * I] every expert's columns. The routing weights (expert order) scale each expert's activations, so
    one matmul reads every gate/up and one every down. The same math summed in another order than the
    rank-order sum `combine` computes: not bit for bit (a drafter's choice, `PackedDecoder.with_dense_experts`)."""
    scores = F.linear(x.float(), router.weight).sigmoid()  # [..., E] fp32
    if router.norm_topk_prob:
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    weights = (scores * router.routed_scaling_factor).to(x.dtype)  # [..., E]
    gate, up = linear(x, gate_up).view(*x.shape[:-1], router.num_experts, 2, -1).unbind(-2)  # [..., E, I] each
    activations = F.silu(gate) * up * weights[..., None]  # [..., E, I]
    return linear(activations.view(*x.shape[:-1], -1), down)


def expert_outputs(
    x: torch.Tensor,
    top_experts: torch.Tensor,
    expert_gate_up: torch.Tensor,
    expert_down: torch.Tensor,
    gate_up_views: tuple[torch.Tensor, ...] = (),
    down_views: tuple[torch.Tensor, ...] = (),
) -> torch.Tensor:
    """Each token's picked SiLU-gated experts, unweighted: x [N, H], top_experts [N, k] → [N*k, H] with
    row token * k + rank. expert_gate_up [E, 2I, H], expert_down [E, H, I] (transformers' fused expert
    tensors); gate_up_views / down_views: the same per expert (`unbind(0)`, no copy), to skip an index op
    per expert. Only the experts some token picked are computed, each once over its tokens.

    One token (a decode step; x [1, H] or [H], top_experts [1, k] or [k]) takes a short path: the same
    `torch.mv` kernels on the same values as the general path, without its bookkeeping."""
    top_k = top_experts.shape[-1]
    if x.dim() == 1 or x.shape[0] == 1:
        row = x if x.dim() == 1 else x[0]  # [H]
        outputs = []
        for expert in (top_experts if top_experts.dim() == 1 else top_experts[0]).tolist():
            gate_up = gate_up_views[expert] if gate_up_views else expert_gate_up[expert]
            down = down_views[expert] if down_views else expert_down[expert]
            gate, up = torch.mv(gate_up, row).chunk(2)
            outputs.append(torch.mv(down, F.silu(gate) * up))
        return torch.stack(outputs)  # [k, H]
    selections: dict[int, list[int]] = {}  # expert → flat (token * k + rank) indices
    for flat, expert in enumerate(top_experts.view(-1).tolist()):
        selections.setdefault(expert, []).append(flat)
    outputs = x.new_empty((x.shape[0] * top_k, x.shape[1]))  # [N*k, H]
    for expert, flat in selections.items():
        if len(flat) == 1:
            rows = x[flat[0] // top_k][None]  # [1, H]
            index = slice(flat[0], flat[0] + 1)
        else:
            index = torch.tensor(flat, device=x.device)
            rows = x.index_select(0, index // top_k)  # [n, H]
        gate, up = linear(rows, expert_gate_up[expert]).chunk(2, dim=-1)
        outputs[index] = linear(F.silu(gate) * up, expert_down[expert])
    return outputs


def quantized_expert_outputs(
    x: torch.Tensor, top_experts: torch.Tensor, gate_up: QuantizedWeight, down: QuantizedWeight
) -> torch.Tensor:
    """`expert_outputs` on quantized experts (`ops.quantize_experts` of transformers' gate_up [E, 2I, H] and down
    [E, H, I]): x [N, H] (or one token [H]), top_experts [N, k] (or [k]) → [N*k, H], row token * k + rank. The
    (token, rank) rows are grouped by expert (a stable sort) and each matmul is one `ops.expert_linear` call for
    all of them, as llama.cpp's `mul_mat_id` and vLLM's fused MoE do; a row's values do not depend on the other
    tokens. One token's k rows need no sort: its experts are distinct, a group of one row each."""
    top_k = top_experts.shape[-1]
    rows = x.reshape(-1, x.shape[-1])  # [N, H]
    flat = top_experts.reshape(-1)  # [N*k]
    if rows.shape[0] == 1:
        order = None
        grouped, experts, offsets = rows.expand(top_k, -1), flat, _rank_offsets(top_k, x.device)
    else:
        order = torch.argsort(flat, stable=True)  # [N*k]: the rows grouped by expert
        experts, counts = torch.unique_consecutive(flat[order], return_counts=True)  # [G] each
        offsets = F.pad(counts.cumsum(0), (1, 0))  # [G + 1]
        grouped = rows.index_select(0, order // top_k)  # [N*k, H]
    gate, up = expert_linear(grouped, gate_up, experts, offsets).chunk(2, dim=-1)
    out = expert_linear(F.silu(gate) * up, down, experts, offsets)  # [N*k, H], grouped
    return out if order is None else torch.empty_like(out).index_copy_(0, order, out)


_RANK_OFFSETS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _rank_offsets(top_k: int, device: torch.device) -> torch.Tensor:
    """[0, 1, ..., k] int64: one token's k expert rows, one group each (kept per k and device)."""
    key = (top_k, device)
    if key not in _RANK_OFFSETS:
        with torch.inference_mode(False):
            _RANK_OFFSETS[key] = torch.arange(top_k + 1, device=device)
    return _RANK_OFFSETS[key]


def combine(outputs: torch.Tensor, top_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """outputs [N*k, H] weighted by top_weights [N, k] and summed over each token's k in rank order → [N, H]
    in `dtype` (fp32 weights, as glm4_moe's, give an fp32 sum that is cast back once). One token may come
    as top_weights [k] → [H]."""
    top_k = top_weights.shape[-1]
    num_tokens = 1 if top_weights.dim() == 1 else top_weights.shape[0]
    out = (outputs * top_weights.view(-1, 1)).view(num_tokens, top_k, -1).sum(dim=1)
    if out.dtype != dtype:
        out = out.to(dtype)
    return out.view(-1) if top_weights.dim() == 1 else out


def routed_experts(
    router: Router,
    x: torch.Tensor,
    expert_gate_up: torch.Tensor,
    expert_down: torch.Tensor,
    router_logits: torch.Tensor | None = None,
    gate_up_views: tuple[torch.Tensor, ...] = (),
    down_views: tuple[torch.Tensor, ...] = (),
    quantized: tuple[QuantizedWeight, QuantizedWeight] | None = None,
) -> torch.Tensor:
    """The routed experts of an MoE block on tokens x [N, H] → [N, H]: `route`, `expert_outputs`, `combine`.
    quantized: the experts' (gate_up, down) as `ops.quantize_experts` stacks them, run by
    `quantized_expert_outputs` instead (expert_gate_up and expert_down unused, may be None)."""
    top_weights, top_experts = route(router, x, router_logits)
    if quantized is not None:
        outputs = quantized_expert_outputs(x, top_experts, *quantized)
    else:
        outputs = expert_outputs(x, top_experts, expert_gate_up, expert_down, gate_up_views, down_views)
    return combine(outputs, top_weights, x.dtype)
