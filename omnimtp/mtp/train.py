"""Train an MTP head for a frozen causal LM by self-distillation (CE + TV, unrolled k steps).

The target is the teacher: on text windows x_0..x_{L-1} it gives its final-norm hidden rows h_t
and its next-token distributions p_t = softmax(lm_head(h_t)) (p_t is the distribution of x_{t+1}).
The head is unrolled k steps exactly as it drafts at inference:

    step 1, index t:  input (x_{t+1}, h_t)           → q_1[t], predicts x_{t+2}, teacher p_{t+1}
    step i, index t:  input (x_{t+i}, g_{i-1}[t])    → q_i[t], predicts x_{t+1+i}, teacher p_{t+i}

where g_{i-1}[t] is the head's own output hidden of step i-1 (before `shared_head_norm`) and the input
tokens are the text's own tokens (the accepted tokens at inference). Attention follows the inference
cache too: at inference the head's cache holds step-1 rows for every accepted position plus the
current chain, so step i at index t attends to step-1 rows u ≤ t and to the chain rows (step j, index
t) for 2 ≤ j ≤ i — not to other step-i rows, which never coexist in the cache. A GLM-5 head selects
its DSA keys among those (`omnimtp.mtp.dsa`), and under IndexShare steps 2..k reuse step 1's selection at
the same index. Its DSA indexer, which no loss below reaches (top-k is not differentiable), is trained by
`indexer_weight` · `omnimtp.mtp.dsa.indexer_kl_loss` on step 1 (the head's own attention as its teacher).

Loss of step i = CE(p, q_i) + tv_weight · TV(p, q_i), weighted by `step_weights[i-1]`. One accepted
token has probability Σ min(p, q) = 1 − TV(p, q), so the TV term pushes acceptance directly.

Held-out acceptance is estimated on the same teacher-forced chains (see `acceptance_estimate`).

Training text: windows of text files (`encode_files`), or self-distillation rows (`generate_distill_rows`):
a window of the training text followed by the target's own continuation, the text greedy speculative
decoding actually drafts on.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from omnimtp.mtp.dsa import dsa_layer, indexer_kl_loss
from omnimtp.mtp.head import MTPHead

DATA_SUFFIXES = (".py", ".txt", ".md", ".rst")
SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})
CHECKPOINT_NAME = "mtp_train_state.pt"


# -- data ---------------------------------------------------------------------------------------------------


def collect_text_files(
    paths: list[str | os.PathLike], heldout_every: int = 16, suffixes: tuple[str, ...] = DATA_SUFFIXES
) -> tuple[list[Path], list[Path]]:
    """(train, heldout) text files under `paths` (files, or directories walked for `suffixes`, skipping
    hidden, test and site-packages directories). One file in `heldout_every` is held out, chosen by a hash
    of its path relative to the directory given (the same split for the same tree, wherever it lives)."""
    if not suffixes:
        raise ValueError("suffixes must name at least one file ending")
    if heldout_every < 2:
        raise ValueError(f"heldout_every must be >= 2, got {heldout_every}")
    if not paths:
        raise ValueError("paths must name at least one file or directory")
    train, heldout = [], []
    for root in map(Path, paths):
        if root.is_file():
            candidates = [(root, root.name)]
        elif root.is_dir():
            candidates = []
            for directory, subdirs, names in os.walk(root):
                subdirs[:] = sorted(d for d in subdirs if d not in SKIPPED_DIRS and not d.startswith("."))
                for name in sorted(names):
                    path = Path(directory) / name
                    if name.endswith(tuple(suffixes)):
                        candidates.append((path, str(path.relative_to(root))))
        else:
            raise ValueError(f"paths: {str(root)!r} is neither a file nor a directory")
        for path, relative in candidates:
            digest = hashlib.sha1(relative.encode()).digest()
            (heldout if digest[0] % heldout_every == 0 else train).append(path)
    if not train:
        raise ValueError(f"paths: no training text files found under {[str(p) for p in paths]}")
    return sorted(train), sorted(heldout)


def encode_files(tokenizer, files: list[Path]) -> torch.Tensor:
    """All files tokenized and concatenated, each followed by EOS when the tokenizer has one. [N] int32."""
    ids: list[int] = []
    for path in files:
        ids.extend(tokenizer(path.read_text(encoding="utf-8", errors="replace"))["input_ids"])
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.int32)


def sample_windows(stream: torch.Tensor, step: int, batch_size: int, seq_len: int, seed: int) -> torch.Tensor:
    """`batch_size` random windows of `seq_len` tokens; a function of (seed, step) only, so a resumed run
    sees the same batches. `stream`: token ids [N], or rows [N, seq_len] (self-distillation data, see
    `generate_distill_rows`) of which whole rows are drawn. [B, L] int64."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    if stream.dim() == 2:
        if stream.shape[1] != seq_len or stream.shape[0] < 1:
            raise ValueError(f"stream: rows of shape {tuple(stream.shape)}, need [N >= 1, seq_len={seq_len}]")
        rows = torch.randint(0, stream.shape[0], (batch_size,), generator=generator)
        return stream[rows].long()
    if stream.numel() <= seq_len:
        raise ValueError(f"stream: {stream.numel()} tokens, need more than seq_len={seq_len}")
    starts = torch.randint(0, stream.numel() - seq_len, (batch_size,), generator=generator)
    return torch.stack([stream[s : s + seq_len] for s in starts.tolist()]).long()


def eval_windows(stream: torch.Tensor, num_windows: int, seq_len: int) -> torch.Tensor:
    """`num_windows` evenly spaced windows of the held-out stream. [W, L] int64."""
    if stream.numel() <= seq_len:
        raise ValueError(f"stream: {stream.numel()} held-out tokens, need more than seq_len={seq_len}")
    stride = max(1, (stream.numel() - seq_len) // num_windows)
    starts = [min(i * stride, stream.numel() - seq_len) for i in range(num_windows)]
    return torch.stack([stream[s : s + seq_len] for s in starts]).long()


@torch.no_grad()
def generate_distill_rows(
    target: nn.Module,
    train_stream: torch.Tensor,
    num_rows: int,
    *,
    seq_len: int = 256,
    prompt_len: int = 64,
    temperature: float = 0.0,
    seed: int = 0,
    batch_size: int = 32,
    progress: bool = True,
) -> torch.Tensor:
    """Self-distillation data (Medusa-2 / EAGLE style): text the target itself generated.

    Row r = a window of `prompt_len` tokens of `train_stream` (start drawn from `seed`) followed by the
    target's own continuation of `seq_len - prompt_len` tokens (`plain_generate`: greedy at temperature 0,
    else sampled at `temperature` with row seed `seed * 1_000_003 + r`, so a row does not depend on
    `batch_size`). EOS does not end a row: the target continues past it as it does across the concatenated
    training files. Greedy speculative decoding drafts on exactly such text (a prompt, then the target's
    greedy output), which windows of the training files do not contain. → rows [num_rows, seq_len] int32.
    """
    from omnimtp.sampling import SamplingParams
    from omnimtp.spec_decode.generate import plain_generate

    for name, value in (("num_rows", num_rows), ("prompt_len", prompt_len), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= prompt_len:
        raise ValueError(f"seq_len must be an integer > prompt_len={prompt_len}, got {seq_len!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
        0 <= temperature < float("inf")
    ):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if train_stream.dim() != 1 or train_stream.numel() <= prompt_len:
        raise ValueError(f"train_stream must be 1-D with more than prompt_len={prompt_len} tokens")
    sampling = SamplingParams.greedy() if temperature == 0 else SamplingParams(temperature=float(temperature))
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, train_stream.numel() - prompt_len, (num_rows,), generator=generator).tolist()
    was_training = target.training
    target.eval()
    rows = []
    bar = _progress_bar(
        range(0, num_rows, batch_size), num_rows, 0, progress, desc="self-distill", unit_scale=batch_size
    )
    try:
        for first in bar:
            batch_starts = starts[first : first + batch_size]
            prompts = torch.stack([train_stream[s : s + prompt_len] for s in batch_starts]).long()  # [b, P]
            row_seeds = [seed * 1_000_003 + first + i for i in range(len(batch_starts))]
            sequences = plain_generate(target, prompts, max_new_tokens=seq_len - prompt_len, sampling=sampling,
                                        seed=row_seeds, eos_token_id=[])  # [b, L]
            rows.append(sequences.to(torch.int32))
    finally:
        target.train(was_training)
    return torch.cat(rows)


# -- the unrolled head ----------------------------------------------------------------------------------------


@torch.no_grad()
def teacher_outputs(target: nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen target on `input_ids` [B, L]: final-norm hidden rows [B, L, H] and logits [B, L, V]."""
    hidden = target.get_decoder()(input_ids=input_ids).last_hidden_state  # [B, L, H]
    logits = target.get_output_embeddings()(hidden)  # [B, L, V]
    return hidden, logits.float()


def _chain_mask(num_rows: list[int], step: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask [1, 1, Q, K] for the rows of `step` (1-based) against the cached rows of steps 1..step.

    Segment j holds `num_rows[j-1]` rows (index t = 0..); query (step, t) sees step-1 rows u ≤ t and,
    for 2 ≤ j ≤ step, the single row (j, t)."""
    num_queries = num_rows[step - 1]
    query = torch.arange(num_queries, device=device)[:, None]  # [Q, 1]
    blocks = []
    for j in range(1, step + 1):
        key = torch.arange(num_rows[j - 1], device=device)[None, :]  # [1, K_j]
        blocks.append(key <= query if j == 1 else key == query)  # [Q, K_j]
    allowed = torch.cat(blocks, dim=1)  # [Q, K]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def unrolled_draft_logits(
    head: MTPHead, input_ids: torch.Tensor, target_hidden: torch.Tensor, num_steps: int,
    indexer_losses: list[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """The head unrolled `num_steps` times on teacher-forced windows, attending like its inference cache.

    input_ids [B, L]; target_hidden [B, L, H] (the target's final-norm rows). Returns one logits tensor per
    step, step i (1-based) of shape [B, L - i, V]: row t predicts token t + 1 + i (teacher: target logits
    row t + i). Step 1 equals `head(input_ids[:, 1:], target_hidden[:, :-1]).logits`. `indexer_losses`: a
    list that receives a DSA head's step-1 `indexer_kl_loss` (its step-1 rows attend causally to each other)."""
    batch_size, seq_len = input_ids.shape
    if num_steps < 1 or num_steps >= seq_len:
        raise ValueError(f"num_steps must be in 1..{seq_len - 1} for windows of {seq_len} tokens, got {num_steps}")
    num_rows = [seq_len - i for i in range(1, num_steps + 1)]
    cache = head.make_cache()
    prev_hidden = target_hidden[:, : seq_len - 1]  # [B, L-1, H]
    all_logits = []
    first_selection = None  # DSA heads: step 1's key selection, reused by later steps under IndexShare
    for step in range(1, num_steps + 1):
        rows = num_rows[step - 1]
        step_ids = input_ids[:, step : step + rows]  # [B, rows] tokens x_{t+step}
        prev_hidden = prev_hidden[:, :rows]  # [B, rows, H]
        embeds = head.embed_tokens(step_ids)  # [B, rows, H]
        hidden = head.eh_proj(torch.cat([head.enorm(embeds), head.hnorm(prev_hidden)], dim=-1))  # [B, rows, H]
        position_ids = (torch.arange(rows, device=input_ids.device) + step)[None].expand(batch_size, -1)
        mask = _chain_mask(num_rows, step, hidden.dtype, hidden.device)  # [1, 1, rows, K]
        position_embeddings = head.rotary_emb(hidden, position_ids)
        if head.is_dsa:
            if step == 1 and indexer_losses is not None:
                normed = head.block.input_layernorm(hidden)
                indexer_losses.append(indexer_kl_loss(head.block.self_attn, normed, position_embeddings))
            allowed = (mask[:, 0] == 0).expand(batch_size, -1, -1)  # [B, rows, K]
            shared = first_selection[:, :rows] if head.index_share and first_selection is not None else None
            hidden, selection = dsa_layer(head.block, hidden, position_embeddings, cache, allowed, shared)
            if first_selection is None:
                first_selection = selection  # [B, L-1, L-1]
        else:
            hidden = head.block(
                hidden, attention_mask=mask, position_ids=position_ids, cache=cache, use_cache=True,
                position_embeddings=position_embeddings,
            )  # [B, rows, H]
        all_logits.append(head.lm_head(head.shared_head_norm(hidden)))  # [B, rows, V]
        prev_hidden = hidden
    return all_logits


def distillation_losses(
    target_logits: torch.Tensor, draft_logits: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per step: (CE(p, q), TV(p, q)) averaged over rows. target_logits [B, L, V]; draft step i [B, L-i, V]."""
    ce, tv = [], []
    for i, logits in enumerate(draft_logits, start=1):
        target_probs = F.softmax(target_logits[:, i : i + logits.shape[1]], dim=-1)  # [B, L-i, V]
        log_q = F.log_softmax(logits.float(), dim=-1)  # [B, L-i, V]
        ce.append(-(target_probs * log_q).sum(-1).mean())
        tv.append(0.5 * (target_probs - log_q.exp()).abs().sum(-1).mean())
    return ce, tv


@torch.no_grad()
def window_acceptance(target_logits: torch.Tensor, draft_logits: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-window acceptance of k-token chains starting at every row t < L - k, teacher-forced on the
    window's tokens: {"greedy", "sampled"} -> [B, k], the mean over the window's chains of "drafts 1..i
    all accepted" for position i (see `acceptance_estimate`). Windows are the unit for standard errors."""
    num_steps = len(draft_logits)
    num_chains = target_logits.shape[1] - num_steps
    greedy_alive = torch.ones(target_logits.shape[0], num_chains, device=target_logits.device)  # [B, C]
    sampled_alive = torch.ones_like(greedy_alive)  # [B, C]
    greedy_rates, sampled_rates = [], []
    for i, logits in enumerate(draft_logits, start=1):
        target = target_logits[:, i : i + num_chains]  # [B, C, V]
        draft = logits[:, :num_chains].float()  # [B, C, V]
        greedy_alive = greedy_alive * (draft.argmax(-1) == target.argmax(-1)).float()
        overlap = torch.minimum(F.softmax(target, dim=-1), F.softmax(draft, dim=-1)).sum(-1)  # [B, C]
        sampled_alive = sampled_alive * overlap
        greedy_rates.append(greedy_alive.mean(dim=1))  # [B]
        sampled_rates.append(sampled_alive.mean(dim=1))  # [B]
    return {"greedy": torch.stack(greedy_rates, dim=1), "sampled": torch.stack(sampled_rates, dim=1)}


@torch.no_grad()
def acceptance_estimate(target_logits: torch.Tensor, draft_logits: list[torch.Tensor]) -> dict:
    """Acceptance of k-token chains starting at every row t < L - k, teacher-forced on the window's tokens.

    greedy: position i is accepted when drafts 1..i all equal the target's argmax;
    sampled (temperature 1): the probability that drafts 1..i are all accepted by rejection sampling,
    Π_{j≤i} Σ_v min(p_j, q_j). τ = 1 + Σ_i acceptance_i (bonus token included)."""
    rates = window_acceptance(target_logits, draft_logits)
    greedy_rates = rates["greedy"].mean(dim=0).tolist()  # [k]
    sampled_rates = rates["sampled"].mean(dim=0).tolist()  # [k]
    return {
        "tau_greedy": 1.0 + sum(greedy_rates),
        "tau_sampled": 1.0 + sum(sampled_rates),
        "acceptance_per_position_greedy": greedy_rates,
        "acceptance_per_position_sampled": sampled_rates,
    }


@torch.no_grad()
def evaluate_head(target: nn.Module, head: MTPHead, windows: torch.Tensor, num_steps: int, batch_size: int = 8) -> dict:
    """Held-out CE, TV and acceptance estimates of `head` on `windows` [W, L] (mean over windows)."""
    was_training = head.training
    head.eval()
    totals: dict[str, float] = {}
    per_position: dict[str, list[float]] = {}
    num_batches = 0
    for start in range(0, windows.shape[0], batch_size):
        batch = windows[start : start + batch_size]  # [b, L]
        hidden, target_logits = teacher_outputs(target, batch)
        draft_logits = unrolled_draft_logits(head, batch, hidden, num_steps)
        ce, tv = distillation_losses(target_logits, draft_logits)
        estimate = acceptance_estimate(target_logits, draft_logits)
        for name, value in [("ce", sum(x.item() for x in ce) / num_steps),
                            ("tv", sum(x.item() for x in tv) / num_steps),
                            ("tau_greedy", estimate["tau_greedy"]), ("tau_sampled", estimate["tau_sampled"])]:
            totals[name] = totals.get(name, 0.0) + value
        for name in ("acceptance_per_position_greedy", "acceptance_per_position_sampled"):
            rates = per_position.setdefault(name, [0.0] * num_steps)
            for i, rate in enumerate(estimate[name]):
                rates[i] += rate
        num_batches += 1
    head.train(was_training)
    result = {name: value / num_batches for name, value in totals.items()}
    result.update({name: [r / num_batches for r in rates] for name, rates in per_position.items()})
    return result


# -- training -----------------------------------------------------------------------------------------------


@dataclass
class MTPTrainConfig:
    """Settings of `train_mtp_head`. `step_weights` default: 0.8 ** (i - 1) for draft step i.

    `tv_weight_start`: when set, the TV weight moves linearly from it at step 0 to `tv_weight` at the last
    step (e.g. 0 → 3: cross-entropy first, where TV's gradient, proportional to q, is weak on tokens the
    head still misses; TV weighs more once q is near p). None: `tv_weight` throughout.

    `indexer_weight`: weight of a GLM-5 head's indexer loss (see the module docstring; other heads have none).

    `distill_fraction`: with `distill_rows` given to `train_mtp_head`, the share of each batch drawn from them
    (round(distill_fraction * batch_size) rows; the rest are windows of the training text)."""

    num_draft_tokens: int = 3
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 1e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    tv_weight: float = 1.0
    tv_weight_start: float | None = None
    indexer_weight: float = 1.0
    step_weights: tuple[float, ...] | None = None
    eval_every: int = 100
    num_eval_windows: int = 16
    checkpoint_every: int = 100
    seed: int = 0
    distill_fraction: float = 1.0

    def __post_init__(self):
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        for name in ("steps", "batch_size", "eval_every", "num_eval_windows", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.seq_len <= self.num_draft_tokens + 1:
            raise ValueError(f"seq_len must exceed num_draft_tokens + 1, got {self.seq_len}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive finite number, got {self.lr}")
        if self.warmup_steps < 0 or self.weight_decay < 0:
            raise ValueError("warmup_steps and weight_decay must be >= 0")
        if not (self.tv_weight >= 0 and math.isfinite(self.tv_weight)):
            raise ValueError(f"tv_weight must be a finite number >= 0, got {self.tv_weight}")
        if not (self.indexer_weight >= 0 and math.isfinite(self.indexer_weight)):
            raise ValueError(f"indexer_weight must be a finite number >= 0, got {self.indexer_weight}")
        if self.tv_weight_start is not None and not (self.tv_weight_start >= 0 and math.isfinite(self.tv_weight_start)):
            raise ValueError(f"tv_weight_start must be None or a finite number >= 0, got {self.tv_weight_start}")
        if not (0.0 <= self.distill_fraction <= 1.0):
            raise ValueError(f"distill_fraction must be in [0, 1], got {self.distill_fraction}")
        if self.step_weights is None:
            self.step_weights = tuple(0.8**i for i in range(self.num_draft_tokens))
        self.step_weights = tuple(float(w) for w in self.step_weights)
        if len(self.step_weights) != self.num_draft_tokens or any(not w >= 0 for w in self.step_weights):
            raise ValueError(
                f"step_weights must be {self.num_draft_tokens} numbers >= 0, got {self.step_weights}"
            )

    def tv_weight_at(self, step: int) -> float:
        """The TV weight of training step `step` (0-based)."""
        if self.tv_weight_start is None:
            return self.tv_weight
        progress = min(1.0, step / max(1, self.steps - 1))
        return self.tv_weight_start + (self.tv_weight - self.tv_weight_start) * progress

    def learning_rate(self, step: int) -> float:
        """Linear warmup, then cosine decay to 10% of `lr`."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        return self.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


@dataclass
class MTPTrainResult:
    head: MTPHead
    losses: list[float] = field(default_factory=list)  # training loss per step (this run and resumed ones)
    evals: list[dict] = field(default_factory=list)  # {"step": ..., held-out metrics} per evaluation
    start_step: int = 0  # the step this run began at (> 0: resumed from a training state)


def _head_parameters(head: MTPHead, target: nn.Module) -> dict[str, nn.Parameter]:
    """The head's own parameters (never the target's shared embedding / lm_head)."""
    target_ids = {id(p) for p in target.parameters()}
    return {name: p for name, p in head.named_parameters() if id(p) not in target_ids}


def train_mtp_head(
    target: nn.Module,
    head: MTPHead,
    train_stream: torch.Tensor,
    eval_stream: torch.Tensor,
    config: MTPTrainConfig | None = None,
    *,
    checkpoint_dir: str | os.PathLike | None = None,
    resume: bool = False,
    stop_after: int | None = None,
    progress: bool = True,
    distill_rows: torch.Tensor | None = None,
) -> MTPTrainResult:
    """Train `head` (in place) to draft `target`'s own distributions; the target stays frozen.

    train_stream: token ids [N] (see `encode_files`) or rows [N, seq_len] (see `generate_distill_rows`);
    eval_stream: token ids [N]. `distill_rows` [N, seq_len] (see `generate_distill_rows`): each batch takes
    round(config.distill_fraction * batch_size) of its windows from them and the rest from train_stream.
    With `checkpoint_dir`, the training state
    (head, optimizer, step, history) is saved every `checkpoint_every` steps and at the end, and `resume=True`
    continues from it (batches depend only on (seed, step), so a resumed run matches an uninterrupted one).
    `stop_after` ends this call after that many steps (a time-boxed run; resume later).
    The final head is not written here: call `head.save_pretrained(dir)`."""
    config = config or MTPTrainConfig()
    if stop_after is not None and stop_after < 1:
        raise ValueError(f"stop_after must be >= 1, got {stop_after}")
    if train_stream.dim() not in (1, 2) or eval_stream.dim() != 1:
        raise ValueError("train_stream must be 1-D token ids or 2-D rows [N, seq_len]; eval_stream 1-D token ids")
    if train_stream.dim() == 2 and train_stream.shape[1] != config.seq_len:
        raise ValueError(f"train_stream: rows of {train_stream.shape[1]} tokens, config.seq_len is {config.seq_len}")
    num_distill = 0
    if distill_rows is not None:
        if distill_rows.dim() != 2 or distill_rows.shape[1] != config.seq_len:
            raise ValueError(f"distill_rows: shape {tuple(distill_rows.shape)}, need [N, seq_len={config.seq_len}]")
        num_distill = round(config.distill_fraction * config.batch_size)
    own = _head_parameters(head, target)
    if not own:
        raise ValueError("head has no parameters of its own to train")
    optimizer = torch.optim.AdamW(list(own.values()), lr=config.lr, betas=(0.9, 0.95),
                                  weight_decay=config.weight_decay)
    result = MTPTrainResult(head=head)
    start_step = 0
    checkpoint_path = Path(checkpoint_dir) / CHECKPOINT_NAME if checkpoint_dir is not None else None
    if resume:
        if checkpoint_path is None:
            raise ValueError("resume=True needs checkpoint_dir")
        if checkpoint_path.exists():
            state = torch.load(checkpoint_path, map_location="cpu")
            head.load_state_dict(state["head"], strict=True)
            optimizer.load_state_dict(state["optimizer"])
            start_step, result.losses, result.evals = state["step"], state["losses"], state["evals"]
            result.start_step = start_step

    device = next(target.parameters()).device  # batches are drawn on the CPU (seeded) and moved there
    windows = eval_windows(eval_stream, config.num_eval_windows, config.seq_len).to(device)
    shared = [p for p in target.parameters()]
    saved_requires_grad = [p.requires_grad for p in shared]
    was_training = (target.training, head.training)
    target.eval()
    head.train()
    try:
        for p in shared:
            p.requires_grad_(False)
        if start_step == 0:
            result.evals.append({"step": 0, **evaluate_head(target, head, windows, config.num_draft_tokens)})
        end_step = config.steps if stop_after is None else min(config.steps, start_step + stop_after)
        bar = _progress_bar(range(start_step, end_step), config.steps, start_step, progress)
        for step in bar:
            for group in optimizer.param_groups:
                group["lr"] = config.learning_rate(step)
            parts = []  # [B, L] in all: self-distillation rows first, then text windows
            if num_distill:
                parts.append(sample_windows(distill_rows, step, num_distill, config.seq_len, config.seed))
            if num_distill < config.batch_size:
                parts.append(sample_windows(train_stream, step, config.batch_size - num_distill, config.seq_len,
                                            config.seed))
            batch = torch.cat(parts).to(device)  # [B, L]
            hidden, target_logits = teacher_outputs(target, batch)
            indexer_losses = [] if head.is_dsa and config.indexer_weight > 0 else None
            draft_logits = unrolled_draft_logits(head, batch, hidden, config.num_draft_tokens, indexer_losses)
            ce, tv = distillation_losses(target_logits, draft_logits)
            tv_weight = config.tv_weight_at(step)
            loss = sum(w * (c + tv_weight * t) for w, c, t in zip(config.step_weights, ce, tv, strict=True))
            if indexer_losses:
                loss = loss + config.indexer_weight * indexer_losses[0]
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(own.values()), 1.0)
            optimizer.step()
            result.losses.append(loss.item())
            done = step + 1
            if done % config.eval_every == 0 or done == config.steps:
                result.evals.append({"step": done, **evaluate_head(target, head, windows, config.num_draft_tokens)})
            if hasattr(bar, "set_postfix"):
                last = result.evals[-1]
                bar.set_postfix(loss=f"{loss.item():.3f}", tau=f"{last['tau_greedy']:.2f}")
            if checkpoint_path is not None and (done % config.checkpoint_every == 0 or done == config.steps):
                checkpoint_path.parent.mkdir(parents=True, exist_ok=True)
                state = {"head": head.state_dict(),
                         "optimizer": optimizer.state_dict(), "step": done,
                         "losses": result.losses, "evals": result.evals}
                torch.save(state, checkpoint_path)
    finally:
        for p, flag in zip(shared, saved_requires_grad, strict=True):
            p.requires_grad_(flag)
        target.train(was_training[0])
        head.train(was_training[1])
    head.eval()
    return result


def _progress_bar(steps, total: int, initial: int, enabled: bool, desc: str = "train-mtp", unit_scale: int = 1):
    if not enabled:
        return steps
    from tqdm.auto import tqdm

    if unit_scale == 1:
        return tqdm(steps, total=total, initial=initial, desc=desc, mininterval=2.0)
    return _scaled_bar(steps, tqdm(total=total, initial=initial, desc=desc, mininterval=2.0), unit_scale)


def _scaled_bar(steps, bar, unit_scale: int):
    """Iterate `steps`, advancing `bar` by `unit_scale` units (capped at its total) after each one."""
    with bar:
        for item in steps:
            yield item
            bar.update(min(unit_scale, bar.total - bar.n))
