"""Speculative decoding: draft k tokens, verify them in one target forward, keep what the target accepts.

One step, row b, k = 3 (the target's cache holds every token but the pending one, x):

    drafter   → d1 d2 d3                       (MTP head applied 3×, or any `Proposer`)
    target    ← [x, d1, d2, d3] at positions pos..pos+3     → p1 p2 p3 p4   (one forward, k+1 slots)
    verify    → e.g. d1 accepted, d2 rejected → emit [d1, r], n_b = 2
    rollback  : slots of d2, d3 are dropped (see below); r is the new pending token

Ragged batches. Rows accept different counts, but a transformers cache has one length for the whole
batch. We crop the target's (and the drafter's) cache to L + max_b n_b after each step and mark each
row's surplus slots invalid in a 2-D `kv_mask` that is passed as the attention mask from then on; each
row's positions advance by its own n_b. A row therefore attends exactly to its own real tokens at their
own positions — the same attention as a contiguous cache, with masked holes — and no token is re-fed.
Left padding of the prompts is one more set of invalid slots in the same mask. The cost is a few dead
slots per step when rows disagree (never more than k per step; none when every row rejects at the same
place). Rows that finished (EOS or max_new_tokens) leave the batch after the step they finished in: every
cache, the mask and the per-row state keep only the rows still generating (`keep_cache_rows`), so a batch
whose rows accept at different rates does not run its last steps at full width for one slow row. With a
drafter that cannot drop rows (a `Proposer` without `keep_rows`) finished rows ride along instead, emit
nothing and count n_b = 1.

Target backends. `target_backend="packed"` runs the target on `omnimtp.spec_decode.packed_target` (packed
weights, a static KV buffer with the same one-length + kv_mask + crop semantics, SDPA), which removes
most of transformers' per-forward framework time on small models; "transformers" runs the model's own
decoder with a `DynamicCache`; "auto" (default) takes "packed" for supported models on CPU.

GLM-5 targets (DSA) verify on `omnimtp.spec_decode.dsa_target`, whose rows select their sparse-attention
keys exactly as one-token decoding does; their prefill is transformers' forward.

Hybrid targets (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) run on transformers' forward. Their linear-attention
layers hold a recurrent state rather than slots, so no hole can be masked there: each row's state is put
back at its own accepted length after every verify (`omnimtp.spec_decode.hybrid`), while their
full-attention layers follow the slot scheme above.

Adaptive drafting (`num_draft_tokens="auto"`, `omnimtp.spec_decode.adaptive`): before each step a
controller picks k in 0..K from the rows' past acceptance and the costs of a step of as many rows as the
step runs (measured once per model and batch-size bucket); k = 0 is a plain one-token step (the target
reads the pending token, the next one is sampled from its logits) and the drafter reads the slots it
missed with the next step that drafts.

Randomness: every row has its own generator (`seed` + row index, or one seed per row); the first token,
the drafts and the verification draw from it in a fixed order, so a seeded row gives the same tokens
alone or in a batch.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from omnimtp.mtp.head import MTPHead
from omnimtp.runtime.decoder import PackedDecoder
from omnimtp.runtime.kv_cache import KVCache, keep_cache_rows
from omnimtp.sampling import SamplingParams, make_generators, probs_from_logits, row_seeds, sample
from omnimtp.spec_decode.adaptive import (
    AUTO,
    DEFAULT_MAX_DRAFT_TOKENS,
    DraftController,
    DraftCosts,
    DraftCostTable,
    FixedDrafts,
    ScheduledDrafts,
    batch_buckets,
    calibrate,
    check_num_draft_tokens,
)
from omnimtp.spec_decode.cost_cache import cost_fingerprint
from omnimtp.spec_decode.dsa_target import dsa_verify_forward, is_dsa_target
from omnimtp.spec_decode.hybrid import crop_attention, linear_layer_indices, rollback, snapshot, verify_blocks
from omnimtp.spec_decode.packed_target import (
    packed_forward,
    packed_logits,
    packed_target,
    stored_mode,
    unsupported_reason,
)
from omnimtp.spec_decode.proposer import (
    DraftInput,
    MTPProposer,
    Proposer,
    check_drafts,
    select_rows,
    with_plain_steps,
)
from omnimtp.spec_decode.rejection import rejection_sample


@dataclass(frozen=True)
class SpecConfig:
    """Validated settings of one speculative run."""

    num_draft_tokens: int | str  # k >= 1, or "auto" (adaptive, see `omnimtp.spec_decode.adaptive`)
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams.greedy)

    def __post_init__(self):
        check_num_draft_tokens(self.num_draft_tokens)
        value = self.max_new_tokens
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {value!r}")
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {self.sampling!r}")
        if self.sampling.repetition_penalty != 1.0:
            raise ValueError("sampling.repetition_penalty is not supported by speculative decoding (must be 1.0)")


@dataclass
class SpecStats:
    """Acceptance and time of one run. A "row-step" is one verify forward of one unfinished row.

    mean_acceptance_length τ = 1 + accepted / row-steps (the bonus/recovered token included);
    acceptance_per_position[i] = row-steps whose draft i+1 was accepted / row-steps;
    acceptance_rate = accepted / drafted. Counts come from verification, before EOS/length truncation.
    num_draft_tokens: k, or the most an adaptive run may draft; an adaptive run also reports the costs it
    decided with (`draft_costs`, relative to a plain step) and how many steps drafted each k
    (`draft_histogram`, k = 0: plain steps; they count as row-steps)."""

    num_draft_tokens: int
    num_steps: int = 0  # verify forwards (batch-wide)
    num_row_steps: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    num_generated_tokens: int = 0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    decode_time_s: float = 0.0  # the steps after the prefill (drafts, verifies and the loop's own work)
    total_time_s: float = 0.0
    draft_costs: tuple[float, ...] | None = None  # the costs at the run's batch size (its first step's)
    draft_costs_by_batch: dict[int, tuple[float, ...]] | None = None  # the whole table: {rows: costs}
    draft_histogram: dict[int, int] = field(default_factory=dict)

    @property
    def is_adaptive(self) -> bool:
        return self.draft_costs is not None

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted / self.num_row_steps if self.num_row_steps else 1.0

    @property
    def acceptance_per_position(self) -> list[float]:
        if not self.num_row_steps:
            return [0.0] * self.num_draft_tokens
        return [count / self.num_row_steps for count in self.accepted_per_position]

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated_tokens / self.total_time_s if self.total_time_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "num_draft_tokens": self.num_draft_tokens,
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_per_position": self.acceptance_per_position,
            "acceptance_rate": self.acceptance_rate,
            "num_steps": self.num_steps,
            "num_row_steps": self.num_row_steps,
            "num_generated_tokens": self.num_generated_tokens,
            "draft_time_s": self.draft_time_s,
            "verify_time_s": self.verify_time_s,
            "decode_time_s": self.decode_time_s,
            "total_time_s": self.total_time_s,
            "tokens_per_s": self.tokens_per_s,
            "draft_costs": self.draft_costs,
            "draft_costs_by_batch": self.draft_costs_by_batch,
            "draft_histogram": dict(self.draft_histogram),
        }


@dataclass
class SpecOutput:
    sequences: torch.Tensor  # [B, P + generated] prompt + generated, finished rows padded like `generate`
    stats: SpecStats


def _eos_ids(target, eos_token_id) -> list[int]:
    if eos_token_id is None:
        eos_token_id = target.generation_config.eos_token_id
    if eos_token_id is None:
        return []
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    for value in ids:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"eos_token_id must be an int or a list of ints, got {eos_token_id!r}")
    return ids


def _check_head(target, head: MTPHead) -> None:
    config = target.config.get_text_config(decoder=True)
    if head.hidden_size != config.hidden_size:
        raise ValueError(f"head: hidden size {head.hidden_size} does not match the target's {config.hidden_size}")
    target_vocab = target.get_output_embeddings().weight.shape[0]
    if head.vocab_size != target_vocab:
        raise ValueError(f"head: vocab size {head.vocab_size} does not match the target's {target_vocab}")


TARGET_BACKENDS = ("auto", "packed", "transformers")


def _packed_or_none(target, target_backend: str, quantize: str | None = None) -> PackedDecoder | None:
    """The packed target for backend "packed" (ValueError when unsupported) or "auto" on a supported CPU
    model; None means transformers' forward. quantize (or a target loaded quantized): the quantized packed
    target, which only the packed backend runs (ValueError naming `quantize` where it does not apply)."""
    if target_backend not in TARGET_BACKENDS:
        raise ValueError(f"target_backend must be one of {TARGET_BACKENDS}, got {target_backend!r}")
    if quantize is not None or stored_mode(target) is not None:
        if target_backend == "transformers":
            raise ValueError(f"quantize={quantize!r}: a quantized target runs on the packed backend, not "
                             "target_backend='transformers' (the float model's forward)")
        return packed_target(target, quantize)  # ValueError naming quantize for an unsupported model or device
    if target_backend == "transformers":
        return None
    if target_backend == "auto":
        on_cpu = all(p.device.type == "cpu" for p in target.parameters())
        return packed_target(target) if on_cpu and unsupported_reason(target) is None else None
    reason = unsupported_reason(target)
    if reason is not None:
        raise ValueError(f"target_backend='packed': {reason}")
    return packed_target(target)


def _target_forward(
    target, packed: PackedDecoder | None, input_ids, position_ids, kv_mask, cache, last_logits_only: bool = False,
    record_layer_inputs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """→ post-norm hidden [B, T, H], logits [B, T, V] (float32; [B, 1, V] with last_logits_only), and with
    record_layer_inputs (transformers' forward only) the input of every decoder layer (`hidden_states`).
    `cache` is a `KVCache` when `packed` is given, else a DynamicCache. A kv_mask without invalid slots is
    passed as None (same attention; no padding mask is needed, and none at all for one token)."""
    if bool(kv_mask.all()):
        kv_mask = None
    if packed is not None:
        hidden = packed_forward(packed, cache, input_ids, position_ids, kv_mask)
        return hidden, packed_logits(packed, hidden[:, -1:] if last_logits_only else hidden), None
    out = target.get_decoder()(
        input_ids=input_ids, attention_mask=kv_mask, position_ids=position_ids, cache=cache, use_cache=True,
        output_hidden_states=record_layer_inputs,
    )
    hidden = out.last_hidden_state
    logits = target.get_output_embeddings()(hidden[:, -1:] if last_logits_only else hidden).float()
    return hidden, logits, out.hidden_states if record_layer_inputs else None


def _check_prompt(input_ids, attention_mask) -> torch.Tensor:
    """Validate a left-padded prompt batch → its attention mask (all ones when None)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise ValueError(
            f"input_ids must be a LongTensor [B, P] with P >= 1, got {getattr(input_ids, 'shape', input_ids)!r}"
        )
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask must match input_ids {tuple(input_ids.shape)}, got {tuple(attention_mask.shape)}"
        )
    if not bool(attention_mask[:, -1].all()) or not bool((attention_mask.diff(dim=1) >= 0).all()):
        raise ValueError("attention_mask must be left padding: 0s then 1s, with every row's last token real")
    return attention_mask


def greedy_verify(target_argmax: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rejection_sample(one_hot(target_argmax), draft_tokens, greedy=True)` without building [B, k+1, V]
    one-hot probabilities: target_argmax [B, k+1], draft_tokens [B, k] → tokens [B, k+1] (−1 padded),
    num_emitted [B]. Same rule: accept while draft == argmax, then emit the argmax after the accepted prefix."""
    batch_size, num_draft = draft_tokens.shape
    rows = torch.arange(batch_size, device=draft_tokens.device)
    accept = draft_tokens == target_argmax[:, :num_draft]  # [B, k]
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [B]
    positions = torch.arange(num_draft + 1, device=draft_tokens.device)
    padded_drafts = torch.cat([draft_tokens, draft_tokens.new_full((batch_size, 1), -1)], dim=1)  # [B, k+1]
    tokens = torch.where(positions[None] < num_accepted[:, None], padded_drafts, -1)  # [B, k+1]
    tokens[rows, num_accepted] = target_argmax[rows, num_accepted]
    return tokens, num_accepted + 1


def speculative_generate(
    target,
    head: MTPHead | Proposer,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int,
    num_draft_tokens: int | str,
    sampling: SamplingParams | None = None,
    seed: int | list[int | None] | None = None,
    eos_token_id: int | list[int] | None = None,
    target_backend: str = "auto",
    draft_costs: DraftCosts | DraftCostTable | None = None,
    quantize: str | None = None,
) -> SpecOutput:
    """Generate with drafts from `head` (an MTPHead, or any Proposer) verified by `target`.

    input_ids [B, P] (left-padded when ragged) with attention_mask [B, P]. sampling None = greedy, whose
    output is token-for-token `target.generate(do_sample=False)`; with sampling every token has the
    target's (temperature/top-k/top-p filtered) distribution. eos_token_id defaults to the target's
    generation config; finished rows are padded with its pad_token_id (else the first EOS id).
    target_backend: "auto" (packed on supported CPU models, else transformers), "packed" (ValueError if the
    model is unsupported) or "transformers" (the model's own forward); see the module docstring.
    quantize: None (float) or "int8" / "int4" / "w4a8": the target runs quantized on the packed backend
    (`packed_target(target, quantize)`: its layers' linears quantized, its LM head int8; CPU only); greedy output
    is then `plain_generate(..., quantize=quantize)`'s, and the MTP head drafts in float. A target loaded from a
    quantized checkpoint runs in its mode (None or that mode). ValueError naming `quantize` for another mode,
    an unsupported model, a non-CPU device or target_backend="transformers".
    num_draft_tokens: k >= 1 drafts every step, or "auto": each step drafts 0..K tokens, whatever the rows'
    acceptance so far makes fastest at this batch size (`omnimtp.spec_decode.adaptive`), with draft_costs
    (one `DraftCosts`, or a `DraftCostTable` per batch size; K = its max_draft_tokens) or, when None, costs
    measured once per model, batch-size bucket and sampling and then reused (`calibrate_draft_costs`);
    the stats report them. Greedy output is the same either way, and a
    seeded request repeats exactly with the same costs.

    Runs under `torch.inference_mode` (about 10% less per-op overhead than no_grad on small CPU models);
    the returned sequences are ordinary tensors."""
    config = SpecConfig(num_draft_tokens, max_new_tokens, sampling if sampling is not None else SamplingParams.greedy())
    if draft_costs is not None and not isinstance(draft_costs, (DraftCosts, DraftCostTable)):
        kind = type(draft_costs).__name__
        raise ValueError(f"draft_costs must be None, a DraftCosts or a DraftCostTable, got {kind}")
    if draft_costs is not None and num_draft_tokens != AUTO:
        raise ValueError("draft_costs: set only with num_draft_tokens='auto'")
    _check_prompt(input_ids, attention_mask)
    with torch.inference_mode():
        if num_draft_tokens == AUTO:
            if draft_costs is None:
                bucket = batch_buckets(input_ids.shape[0])[-1]
                draft_costs = {bucket: calibrate_draft_costs(
                    target, head, batch_size=bucket, sampling=config.sampling, target_backend=target_backend,
                    quantize=quantize,
                )}
            controller = DraftController(draft_costs, input_ids.shape[0])
        else:
            controller = FixedDrafts(num_draft_tokens)
        out = _speculative_generate(
            target, head, input_ids, attention_mask, controller, max_new_tokens=max_new_tokens,
            sampling=config.sampling, seed=seed, eos_token_id=eos_token_id, target_backend=target_backend,
            quantize=quantize,
        )
    return SpecOutput(sequences=out.sequences.clone(), stats=out.stats)  # clone: a normal tensor outside


def calibrate_draft_costs(
    target, head: MTPHead | Proposer, *, batch_size: int = 1, sampling: SamplingParams | None = None,
    target_backend: str = "auto", max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS, quantize: str | None = None,
) -> DraftCosts:
    """What a step drafting k = 0..max_draft_tokens tokens costs relative to a plain step, measured on
    this target, drafter and backend at this batch size and sampling: steps of this loop on fixed 16-token
    prompts, each k in turn step by step (`adaptive.calibrate`; a fresh run, prompt and seed per cycle), and
    the drafts' acceptance in those steps (`DraftCosts.acceptance`, an auto run's prior). Measured once per
    model and key, then reused (frozen) by every `num_draft_tokens="auto"` run that passes no draft_costs
    (at the bucket of its batch size, `batch_buckets(B)[-1]`), and kept on disk for the next process
    (`omnimtp.spec_decode.cost_cache`). quantize: the target's mode, as `speculative_generate` takes it."""
    sampling = sampling if sampling is not None else SamplingParams.greedy()
    if isinstance(max_draft_tokens, bool) or not isinstance(max_draft_tokens, int) or max_draft_tokens < 1:
        raise ValueError(f"max_draft_tokens must be an integer >= 1, got {max_draft_tokens!r}")
    vocab = target.get_output_embeddings().weight.shape[0]
    device = target.get_output_embeddings().weight.device
    cycles = itertools.count()

    def time_cycle(ks: list[int]) -> list[tuple[float, int, int]]:
        # each cycle its own prompt and seed: the acceptance is observed on more than one continuation
        cycle = next(cycles)
        prompt = (torch.arange(16, device=device) * 7 + 3 + 11 * cycle).remainder(vocab)
        prompt = prompt.expand(batch_size, -1)  # [B, 16]
        controller = ScheduledDrafts([*ks, 0])  # the extra step ends the last timed one
        with torch.inference_mode():
            _speculative_generate(
                target, head, prompt, None, controller, max_new_tokens=(len(ks) + 1) * (max(ks) + 1),  # no row ends
                sampling=sampling, seed=cycle,
                eos_token_id=[], target_backend=target_backend, max_steps=len(ks) + 1, quantize=quantize,
            )
        starts, counts = controller.step_starts, controller.counts[: len(ks)]
        return [(end - start, *step) for start, end, step in zip(starts[:-1], starts[1:], counts, strict=True)]

    key = (id(head), target_backend, sampling, batch_size, str(device), quantize)
    def fingerprint() -> dict:
        return cost_fingerprint(target, head, device=device, key={
            "loop": "speculative_generate", "backend": target_backend, "sampling": repr(sampling),
            "batch_size": batch_size, "max_draft_tokens": max_draft_tokens,
            **({"quantize": quantize} if quantize is not None else {}),
        })

    return calibrate(target, key, time_cycle, max_draft_tokens, fingerprint)


def calibrate_draft_cost_table(
    target, head: MTPHead | Proposer, *, max_batch_size: int, sampling: SamplingParams | None = None,
    target_backend: str = "auto", max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS, quantize: str | None = None,
) -> DraftCostTable:
    """`calibrate_draft_costs` at every batch-size bucket up to max_batch_size (`batch_buckets`): the table
    an adaptive run decides with at any batch size, each bucket measured once per model and reused."""
    return DraftCostTable(tuple(
        (rows, calibrate_draft_costs(target, head, batch_size=rows, sampling=sampling, target_backend=target_backend,
                                     max_draft_tokens=max_draft_tokens, quantize=quantize))
        for rows in batch_buckets(max_batch_size)
    ))


def _speculative_generate(
    target, head, input_ids, attention_mask, controller, *, max_new_tokens, sampling, seed, eos_token_id,
    target_backend, max_steps: int | None = None, quantize: str | None = None,
) -> SpecOutput:
    """The loop; controller: a `DraftController` or `FixedDrafts`; max_steps: stop after that many steps
    (what calibration times), else at EOS / max_new_tokens."""
    attention_mask = _check_prompt(input_ids, attention_mask)
    batch_size, prompt_len = input_ids.shape
    device = input_ids.device
    packed = _packed_or_none(target, target_backend, quantize)
    linear_layers = linear_layer_indices(target) if packed is None else []
    dsa = packed is None and is_dsa_target(target)
    if isinstance(head, MTPHead):
        _check_head(target, head)
        proposer: Proposer = MTPProposer(head)
    else:
        proposer = head
        proposer.reset()
    is_foreign = not isinstance(proposer, MTPProposer)  # a caller's Proposer: its drafts are checked
    vocab_size = target.get_output_embeddings().weight.shape[0]
    eos_ids = _eos_ids(target, eos_token_id)
    pad_id = target.generation_config.pad_token_id
    if pad_id is None:
        pad_id = eos_ids[0] if eos_ids else 0
    max_k = controller.max_draft_tokens
    generators = None if sampling.is_greedy else make_generators(row_seeds(seed, batch_size), device=device)
    stats = SpecStats(num_draft_tokens=max_k, accepted_per_position=[0] * max_k)
    if isinstance(controller, DraftController):
        stats.draft_costs = controller.costs.for_batch(batch_size).step
        stats.draft_costs_by_batch = controller.costs.to_dict()
    start = time.perf_counter()

    # Prefill: positions as `generate` computes them for left padding.
    kv_mask = attention_mask.long()  # [B, L] validity of every cache slot
    position_ids = (kv_mask.cumsum(dim=-1) - 1).masked_fill(kv_mask == 0, 1)  # [B, P]
    if packed is not None:
        target_cache = KVCache(packed, batch_size, capacity=prompt_len + max_new_tokens + max_k + 1)
    else:
        target_cache = DynamicCache(config=target.config)
    hidden, logits, _ = _target_forward(
        target, packed, input_ids, position_ids, kv_mask, target_cache, last_logits_only=True
    )
    first = sample(logits[:, -1], sampling, generators)  # [B]

    generated: list[list[int]] = [[] for _ in range(batch_size)]
    finished = [False] * batch_size
    live = list(range(batch_size))  # the batch's rows: live[i] is the request row in position i
    can_drop_rows = callable(getattr(proposer, "keep_rows", None))

    def emit(row: int, tokens: list[int]) -> None:
        for token in tokens:
            generated[row].append(token)
            if token in eos_ids or len(generated[row]) >= max_new_tokens:
                finished[row] = True
                return

    for row in range(batch_size):
        emit(row, [int(first[row])])
    pending = first  # [B] emitted, not yet read by the target
    block = DraftInput(  # the slots the drafter has not read yet
        input_ids=input_ids,
        next_ids=torch.cat([input_ids[:, 1:], first[:, None]], dim=1),
        hidden=hidden,
        position_ids=position_ids,
        kv_mask=kv_mask,
        last_index=torch.full((batch_size,), prompt_len - 1, device=device),
    )
    next_position = position_ids[:, -1] + 1  # [B] the pending token's position
    plain_steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # k = 0 steps the drafter has not read

    has_holes = False  # whether a verify left rejected drafts' slots in the mask (left padding aside)

    def forward(ids, positions, mask, record_layer_inputs=False):  # → hidden [B, T, H], logits [B, T, V], layer inputs
        if dsa and (ids.shape[1] > 1 or has_holes):  # one token without holes: `generate`'s own step
            hidden = dsa_verify_forward(target, ids, positions, mask, target_cache, prompt_len)
            return hidden, target.get_output_embeddings()(hidden).float(), None
        return _target_forward(
            target, packed, ids, positions, mask, target_cache, record_layer_inputs=record_layer_inputs
        )

    decode_start = time.perf_counter()
    while not all(finished) and (max_steps is None or stats.num_steps < max_steps):
        if can_drop_rows and any(finished[row] for row in live):  # finished rows leave the batch
            kept = [i for i, row in enumerate(live) if not finished[row]]
            live = [live[i] for i in kept]
            index = torch.tensor(kept, device=device)
            keep_cache_rows(target_cache, kept)
            proposer.keep_rows(kept)
            controller.keep_rows(kept)
            if generators is not None:
                generators = [generators[i] for i in kept]
            kv_mask, pending, next_position = kv_mask[index], pending[index], next_position[index]
            block = select_rows(block, index)
            plain_steps = [tuple(part[index] for part in step) for step in plain_steps]
        num_rows = len(live)
        is_active = [not finished[row] for row in live]
        k = controller.choose(is_active, num_rows)  # rows that finished and stay (see above) ride along
        t0 = time.perf_counter()
        if k == 0:  # a plain step, as `plain_generate` takes it;
            # the drafter reads its slot with the next step that drafts
            kv_mask = torch.cat([kv_mask, kv_mask.new_ones(num_rows, 1)], dim=1)
            hidden, logits, _ = forward(pending[:, None], next_position[:, None], kv_mask)
            token = sample(logits[:, 0], sampling, generators)  # [R]
            plain_steps.append((pending, token, hidden[:, 0]))
            for i, token_id in enumerate(token.tolist()):
                if is_active[i]:
                    emit(live[i], [token_id])
            pending, next_position = token, next_position + 1
            stats.verify_time_s += time.perf_counter() - t0
            stats.num_steps += 1
            stats.num_row_steps += sum(is_active)
            stats.draft_histogram[0] = stats.draft_histogram.get(0, 0) + 1
            continue
        if plain_steps:
            block = with_plain_steps(block, plain_steps, next_position - len(plain_steps), kv_mask)
            plain_steps = []
        draft_tokens, draft_probs = proposer.propose(block, k, sampling, generators)  # [R, k], [R, k, V]
        if is_foreign:
            check_drafts(draft_tokens, num_rows, k, vocab_size)
        t1 = time.perf_counter()

        offsets = torch.arange(k + 1, device=device)
        verify_ids = torch.cat([pending[:, None], draft_tokens], dim=1)  # [R, k+1]
        verify_positions = next_position[:, None] + offsets  # [R, k+1]
        verify_mask = torch.cat([kv_mask, kv_mask.new_ones(num_rows, k + 1)], dim=1)  # [R, L+k+1]
        saved_states = snapshot(target_cache, linear_layers) if linear_layers else None
        with verify_blocks(target) if linear_layers else contextlib.nullcontext():  # hybrids: the recurrent rule
            hidden, logits, layer_inputs = forward(verify_ids, verify_positions, verify_mask, saved_states is not None)
        if sampling.is_greedy:  # probs_from_logits would be one_hot(argmax): verify on the argmax directly
            tokens, num_emitted = greedy_verify(logits.argmax(dim=-1), draft_tokens.long())  # [R, k+1], [R]
        else:
            target_probs = probs_from_logits(logits, sampling)  # [R, k+1, V]
            tokens, num_emitted = rejection_sample(
                target_probs, draft_tokens, draft_probs, greedy=False, generators=generators,
                check_values=is_foreign,  # our own drafts are valid by construction
            )  # [R, k+1], [R]
        stats.verify_time_s += time.perf_counter() - t1
        stats.draft_time_s += t1 - t0

        # The step's counts read back once; the bookkeeping below is plain Python on them.
        emitted_counts = num_emitted.tolist()  # [R]
        accepted_counts = [n - 1 for n in emitted_counts]
        controller.update(k, accepted_counts, is_active)
        active_accepted = [a for a, is_row_active in zip(accepted_counts, is_active, strict=True) if is_row_active]
        stats.num_steps += 1
        stats.draft_histogram[k] = stats.draft_histogram.get(k, 0) + 1
        stats.num_row_steps += len(active_accepted)
        stats.num_drafted += k * len(active_accepted)
        stats.num_accepted += sum(active_accepted)
        for i in range(k):
            stats.accepted_per_position[i] += sum(a > i for a in active_accepted)

        # Rollback: keep max n_b slots of the block, mask each row's surplus.
        kept_counts = [n if is_row_active else 1 for n, is_row_active in zip(emitted_counts, is_active, strict=True)]
        num_kept = torch.tensor(kept_counts, device=device)  # [R]
        block_width = max(kept_counts)
        if block_width < k + 1:
            if packed is not None:
                target_cache.crop(block_width - (k + 1))
            else:
                crop_attention(target_cache, k + 1 - block_width)
        if saved_states is not None:
            rollback(target, target_cache, saved_states, layer_inputs, num_kept)
        if min(kept_counts) == block_width:  # every row kept the whole block (batch 1 always)
            kv_mask = torch.cat([kv_mask, kv_mask.new_ones(num_rows, block_width)], dim=1)
        else:
            kv_mask = torch.cat([kv_mask, (offsets[None, :block_width] < num_kept[:, None]).long()], dim=1)
            has_holes = True

        token_rows = tokens[:, :block_width].tolist()
        for i, row in enumerate(live):
            if is_active[i]:
                emit(row, token_rows[i][: emitted_counts[i]])
        last_index = num_kept - 1  # [R]
        pending = tokens[torch.arange(num_rows, device=device), last_index].clamp(min=0)  # finished rows: any valid id
        next_position = next_position + num_kept
        block = DraftInput(
            input_ids=verify_ids[:, :block_width],
            next_ids=tokens[:, :block_width].clamp(min=0),
            hidden=hidden[:, :block_width],
            position_ids=verify_positions[:, :block_width],
            kv_mask=kv_mask,
            last_index=last_index,
        )

    num_new = max(len(row) for row in generated)
    new_tokens = torch.full((batch_size, num_new), pad_id, dtype=input_ids.dtype, device=device)
    for row in range(batch_size):
        new_tokens[row, : len(generated[row])] = torch.tensor(generated[row], dtype=input_ids.dtype)
    stats.num_generated_tokens = sum(len(row) for row in generated)
    end = time.perf_counter()
    stats.decode_time_s = end - decode_start
    stats.total_time_s = end - start
    return SpecOutput(sequences=torch.cat([input_ids, new_tokens], dim=1), stats=stats)


def plain_generate(
    target,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int,
    sampling: SamplingParams | None = None,
    seed: int | list[int | None] | None = None,
    eos_token_id: int | list[int] | None = None,
    target_backend: str = "auto",
    quantize: str | None = None,
) -> torch.Tensor:
    """Plain decoding (one token per forward) on the same target forward `speculative_generate` uses:
    the honest baseline for speculative decoding. target_backend as there: "auto" runs the packed target
    on supported CPU models and transformers' forward otherwise (e.g. MLA models), "packed" (ValueError
    if unsupported), "transformers". Same contract as `speculative_generate` (left-padded input_ids
    [B, P], sampling None = greedy = `target.generate(do_sample=False)`, seeds per row, EOS / padding like
    `generate`) → sequences [B, P + generated]. A row that emitted EOS leaves the batch (every cache keeps
    only the rows still generating), as in `speculative_generate`. quantize: the quantized target, as there."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    sampling = sampling if sampling is not None else SamplingParams.greedy()
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling must be a SamplingParams, got {sampling!r}")
    attention_mask = _check_prompt(input_ids, attention_mask)
    batch_size = input_ids.shape[0]
    device = input_ids.device
    eos_ids = _eos_ids(target, eos_token_id)
    pad_id = target.generation_config.pad_token_id
    if pad_id is None:
        pad_id = eos_ids[0] if eos_ids else 0
    generators = None if sampling.is_greedy else make_generators(row_seeds(seed, batch_size), device=device)
    with torch.inference_mode():
        packed = _packed_or_none(target, target_backend, quantize)
        if packed is not None:
            cache = KVCache(packed, batch_size, capacity=input_ids.shape[1] + max_new_tokens)
        else:
            cache = DynamicCache(config=target.config)
        kv_mask = attention_mask.long()  # [B, L]
        position_ids = (kv_mask.cumsum(dim=-1) - 1).masked_fill(kv_mask == 0, 1)  # [B, P]
        _, logits, _ = _target_forward(target, packed, input_ids, position_ids, kv_mask, cache, last_logits_only=True)
        positions = position_ids[:, -1:]  # [B, 1]
        eos = torch.tensor(eos_ids, device=device)
        live = list(range(batch_size))  # the batch's rows: rows that emitted EOS leave it
        tokens = torch.full((batch_size, max_new_tokens), pad_id, dtype=input_ids.dtype, device=device)
        for step in range(max_new_tokens):
            token = sample(logits[:, -1], sampling, generators)  # [R]
            tokens[live, step] = token.to(tokens.dtype)
            num_new = step + 1
            done = torch.isin(token, eos)
            if step == max_new_tokens - 1 or bool(done.all()):
                break
            if bool(done.any()):
                kept = (~done).nonzero().squeeze(1)  # [R']
                rows = kept.tolist()
                keep_cache_rows(cache, rows)
                live = [live[i] for i in rows]
                if generators is not None:
                    generators = [generators[i] for i in rows]
                token, kv_mask, positions = token[kept], kv_mask[kept], positions[kept]
            kv_mask = torch.cat([kv_mask, kv_mask.new_ones(len(live), 1)], dim=1)
            positions = positions + 1
            _, logits, _ = _target_forward(target, packed, token[:, None], positions, kv_mask, cache)
        sequences = torch.cat([input_ids, tokens[:, :num_new]], dim=1)
    return sequences.clone()
