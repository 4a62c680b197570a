"""Per-token log-probs of given completions under a model's sampling distribution (temperature, min-p, top-k, top-p).

The hub learner backprops through these and the hub's audits compare them with what nodes
report, so the filtering here is the one the engines sample with (shared/generation.py imports it).

Rows are packed, not padded: each row's prompt and completion sit back to back with other rows' in one
sequence (a bin), at position ids restarting from 0 (the positions it would see alone, as during
generation); transformers reads the restarts as a block-diagonal causal mask (sdpa, eager) or varlen
attention (flash, flex). A varlen kernel takes every row in one bin; a dense one computes each pair of a
bin's tokens before masking, so its bins are only as long as the longest row. The LM head runs on the
positions that predict a completion token only, a chunk of tokens at a time (HEAD_CHUNK_BYTES of
float32 logits), recomputed in backward: the [tokens, vocabulary] log-softmax is never held whole (at
a 152k vocabulary one of 16k tokens is 10 GB of float32).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

# One chunk of the head's float32 logits: ~441 tokens at a 152k vocabulary. Its temporaries (logits, their
# scaled copy, the nucleus sort's) are a few of these, whatever the micro-batch's size.
HEAD_CHUNK_BYTES = 256 << 20
# Config keys of architectures whose forward changes the head's output (Gemma 2/3's soft-capping, Cohere's
# and Granite's scaling): the selective head's output is log-probs, which such a forward would corrupt.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
# Attention implementations that attend within each packed row only (cu_seqlens, or flex's block mask).
VARLEN_ATTENTION = frozenset({"flash_attention_2", "flash_attention_3", "flex_attention"})


def nucleus_removed(scaled_logits: Tensor, top_p: float) -> Tensor:
    """Bool mask of tokens outside the top-p nucleus, with transformers' and vLLM's tie rules.

    Tokens sorted by ascending probability are dropped while their cumulative mass is <= 1 - top_p;
    the most likely token is always kept.
    """
    sorted_logits, sorted_index = torch.sort(scaled_logits, dim=-1, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    removed_sorted = cumulative <= (1.0 - top_p)
    removed_sorted[..., -1] = False
    return removed_sorted.scatter(-1, sorted_index, removed_sorted)


def below_threshold(scaled_logits: Tensor, top_k: int, min_p: float) -> Tensor:
    """Bool mask of tokens that top-k (outside the k largest; ties with the k-th kept) or min-p (probability below
    min_p x the most likely token's) drop, as vLLM's and transformers' filters do; 0 turns either off. Both keep the
    most likely token, and each drops exactly the tokens below a logit threshold, so their order does not matter."""
    threshold = torch.full_like(scaled_logits[..., :1], float("-inf"))
    if 0 < top_k < scaled_logits.shape[-1]:
        threshold = torch.topk(scaled_logits, top_k, dim=-1).values[..., -1:]
    if min_p > 0.0:
        # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p), whatever the normalisation.
        threshold = torch.maximum(threshold, scaled_logits.amax(dim=-1, keepdim=True) + math.log(min_p))
    return scaled_logits < threshold


def sampling_scores(logits: Tensor, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0) -> Tensor:
    """logits / temperature in fp32, -inf where min-p or top-k drops a token, then outside the top-p nucleus of
    what is left (vLLM's order): the sampling distribution's log-probs up to their log-sum-exp."""
    scaled = logits.float() / temperature
    # Which tokens take part is a discrete choice: no gradient flows through it.
    if top_k > 0 or min_p > 0.0:
        scaled = scaled.masked_fill(below_threshold(scaled.detach(), top_k, min_p), float("-inf"))
    if top_p < 1.0:
        scaled = scaled.masked_fill(nucleus_removed(scaled.detach(), top_p), float("-inf"))
    return scaled


def sampling_logprobs(logits: Tensor, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0) -> Tensor:
    """Log-softmax of logits / temperature restricted to what min-p, top-k and top-p keep (-inf elsewhere), in fp32."""
    return torch.log_softmax(sampling_scores(logits, temperature, top_p, top_k, min_p), dim=-1)


def completion_logprobs(
    model,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    scored: Sequence[Sequence[bool] | None] | None = None,
) -> tuple[Tensor, Tensor]:
    """Log-probs [B, T] of each completion token given its prompt (T: the longest completion; 0 past a row's
    end), and a float mask [B, T] of real tokens. One forward pass over the packed rows; differentiable with
    respect to the model's parameters. The model's LM head is swapped for the pass: hold the model alone.
    `scored`: per row, the completion positions to score (a tool-using rollout's model tokens: its environment
    tokens are context only, 0 in the mask and the log-probs); None, or a row's None: all of them."""
    filters = Filters(temperature, top_p, top_k, min_p)
    logprobs, _, mask = _packed_logprobs(model, prompt_ids, completion_ids, filters, entropy=False, scored=scored)
    return logprobs, mask


def completion_logprobs_and_power_sums(
    model,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    orders: Sequence[float],
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    scored: Sequence[Sequence[bool] | None] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """completion_logprobs' log-probs and mask, and log sum_y q(y)^a [B, T, len(orders)] of the sampling distribution
    q at each completion token for each order a (no gradient; 0 past a row's end or where not `scored`), from the
    same forward pass: what a test of how the tokens were sampled needs (hub/trust/sampling.py)."""
    filters = Filters(temperature, top_p, top_k, min_p)
    logprobs, sums, mask = _packed_logprobs(
        model, prompt_ids, completion_ids, filters, entropy=False, orders=tuple(orders), scored=scored
    )
    return logprobs, mask, sums


def completion_logprobs_and_entropy(
    model,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    scored: Sequence[Sequence[bool] | None] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """completion_logprobs' log-probs and mask, and the entropy [B, T] (nats, no gradient) of the sampling
    distribution at each completion token, from the same forward pass (0 past a row's end or where not `scored`)."""
    filters = Filters(temperature, top_p, top_k, min_p)
    logprobs, entropy, mask = _packed_logprobs(model, prompt_ids, completion_ids, filters, entropy=True, scored=scored)
    return logprobs, mask, entropy


@dataclass(frozen=True)
class Filters:
    """The sampling distribution's settings, as sampling_scores takes them."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    def scores(self, logits: Tensor) -> Tensor:
        return sampling_scores(logits, self.temperature, self.top_p, self.top_k, self.min_p)


@dataclass(frozen=True)
class PackedRows:
    """Rows packed into bins: each row's prompt and completion (its last token left out: it predicts nothing
    asked for) at position ids from 0, rows back to back in a bin, each bin's tail a run of padding that starts
    at 0 again. `keep` indexes the flattened [bins, width] positions whose next token is a scored completion token,
    `targets` those tokens, `slots` where each lands in the flattened [rows, longest completion] output."""

    input_ids: Tensor  # [bins, bin width]
    position_ids: Tensor  # [bins, bin width]
    keep: Tensor  # [K]
    targets: Tensor  # [K]
    slots: Tensor  # [K]
    rows: int
    width: int  # the longest completion


def pack_rows(
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    bin_tokens: int | None = None,
    scored: Sequence[Sequence[bool] | None] | None = None,
) -> PackedRows:
    """The rows in bins of max(bin_tokens, the longest row) tokens, first fit, longest first (None: one bin
    holding every row). A row with an empty completion contributes nothing. `scored`: per row, which completion
    tokens are targets (None, or a row's None: all); the others are context only."""
    picks = _checked_rows(prompt_ids, completion_ids, scored)
    width = max((len(c) for c in completion_ids), default=0)
    lengths = {row: len(p) + len(c) - 1 for row, (p, c) in enumerate(zip(prompt_ids, completion_ids)) if c}
    capacity = sum(lengths.values()) if bin_tokens is None else max(bin_tokens, max(lengths.values(), default=0))
    bins = _first_fit(lengths, capacity)
    ids = torch.zeros((len(bins), capacity), dtype=torch.long)
    positions = torch.zeros((len(bins), capacity), dtype=torch.long)
    keep: list[int] = []
    targets: list[int] = []
    slots: list[int] = []
    for b, members in enumerate(bins):
        start = 0
        for row in sorted(members):
            prompt, completion = prompt_ids[row], completion_ids[row]
            stop = start + lengths[row]
            ids[b, start:stop] = torch.tensor([*prompt, *completion[:-1]], dtype=torch.long)
            positions[b, start:stop] = torch.arange(lengths[row])
            # Completion token i is predicted at `first` + i, and lands at row * width + i.
            first = b * capacity + start + len(prompt) - 1
            pick = picks[row]
            at = range(len(completion)) if pick is None else [i for i, wanted in enumerate(pick) if wanted]
            keep.extend(first + i for i in at)
            targets.extend(completion[i] for i in at)
            slots.extend(row * width + i for i in at)
            start = stop
        positions[b, start:] = torch.arange(capacity - start)
    as_long = lambda values: torch.tensor(values, dtype=torch.long)
    return PackedRows(ids, positions, as_long(keep), as_long(targets), as_long(slots), len(prompt_ids), width)


def _checked_rows(
    prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]], scored: Sequence[Sequence[bool] | None] | None
) -> list[Sequence[bool] | None]:
    """pack_rows' rows as it can take them (ValueError naming what it cannot): each row's `scored`."""
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions")
    picks: list[Sequence[bool] | None] = [None] * len(prompt_ids) if scored is None else list(scored)
    if len(picks) != len(prompt_ids) or any(p is not None and len(p) != len(c) for p, c in zip(picks, completion_ids)):
        raise ValueError("scored must name each row's completion positions")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("empty prompt")
    return picks


def _first_fit(lengths: dict[int, int], capacity: int) -> list[list[int]]:
    """The rows (row -> tokens) in bins of `capacity` tokens: first fit, longest first."""
    bins: list[list[int]] = []
    room: list[int] = []
    for row in sorted(lengths, key=lambda r: (-lengths[r], r)):
        fits = next((b for b, free in enumerate(room) if free >= lengths[row]), None)
        if fits is None:
            bins.append([])
            room.append(capacity)
            fits = len(bins) - 1
        bins[fits].append(row)
        room[fits] -= lengths[row]
    return bins


def _packed_logprobs(
    model,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    filters: Filters,
    entropy: bool,
    orders: tuple[float, ...] = (),
    scored: Sequence[Sequence[bool] | None] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Log-probs, mask, each [B, T], and between them the entropy [B, T] (zeros unless asked), or with `orders` the
    log power sums [B, T, len(orders)] (_Chunk); only `scored` positions (pack_rows) are in the mask."""
    # A varlen kernel attends within each packed row only, so one bin holds them all; a dense one (sdpa, eager)
    # computes every pair of a bin's tokens and masks most, so bins stay as long as the longest row.
    varlen = getattr(model.config, "_attn_implementation", None) in VARLEN_ATTENTION
    packed = pack_rows(prompt_ids, completion_ids, None if varlen else 0, scored)
    device = next(model.parameters()).device
    size = packed.rows * packed.width
    slots = packed.slots.to(device)
    mask = torch.zeros(size, device=device).index_fill_(0, slots, 1.0).view(packed.rows, packed.width)
    extra_shape = (packed.rows, packed.width, len(orders)) if orders else (packed.rows, packed.width)
    if not len(packed.targets):
        return torch.zeros((packed.rows, packed.width), device=device), torch.zeros(extra_shape, device=device), mask
    with _selective_head(model, packed.keep.to(device), packed.targets.to(device), filters, entropy, orders) as head:
        # No attention mask: transformers reads the packing off the position ids' restarts.
        token_logprobs = model(
            input_ids=packed.input_ids.to(device), position_ids=packed.position_ids.to(device), use_cache=False
        ).logits
    logprobs = torch.zeros(size, device=device, dtype=token_logprobs.dtype).index_copy(0, slots, token_logprobs)
    extra = torch.zeros((size, *extra_shape[2:]), device=device)
    if entropy or orders:
        extra.index_copy_(0, slots, head.measured())
    return logprobs.view(packed.rows, packed.width), extra.view(extra_shape), mask


class _Chunk:
    """One chunk of the head: the targets' log-probs from the hidden states. Under checkpoint it runs again in
    backward; what it measures of the distribution (no gradient) is taken on its first run only: the entropy, or
    for each of `orders` a the log power sum log sum_y q(y)^a (a Renyi entropy times 1 - a)."""

    def __init__(self, head: torch.nn.Module, targets: Tensor, filters: Filters, entropy: bool, orders: tuple[float, ...]):
        self.head, self.targets, self.filters = head, targets, filters
        self.want_entropy, self.orders = entropy, orders
        self.measured: Tensor | None = None

    def __call__(self, hidden: Tensor) -> Tensor:
        scores = self.filters.scores(self.head(hidden))
        log_total = torch.logsumexp(scores, dim=-1)
        if (self.want_entropy or self.orders) and self.measured is None:
            with torch.no_grad():
                # Outside the nucleus the log-prob is -inf and the probability 0: it adds nothing to either.
                if self.orders:
                    # log sum q^a = logsumexp(a * scores) - a * log_total: one pass over the vocabulary per order.
                    detached, total = scores.detach(), log_total.detach()
                    sums = [torch.logsumexp(a * detached, dim=-1) - a * total for a in self.orders]
                    self.measured = torch.stack(sums, dim=-1)
                else:
                    self.measured = torch.special.entr((scores.detach() - log_total.detach()[:, None]).exp()).sum(-1)
        return scores.gather(-1, self.targets[:, None]).squeeze(-1) - log_total


class _SelectiveHead(torch.nn.Module):
    """Stands in for a causal LM's head for one forward: from the hidden states [bins, width, H] it returns the
    log-probs [K] of the targets at the kept positions, a chunk of tokens at a time. Inside the model's own
    forward, so FSDP2 gathers the head's weights as for the real one."""

    def __init__(
        self,
        head: torch.nn.Module,
        keep: Tensor,
        targets: Tensor,
        filters: Filters,
        entropy: bool,
        orders: tuple[float, ...],
        vocab: int,
    ):
        super().__init__()
        self.head = head
        self.keep = keep
        self.targets, self.filters, self.want_entropy, self.orders = targets, filters, entropy, orders
        self.chunk_tokens = max(1, HEAD_CHUNK_BYTES // (4 * vocab))
        self.chunks: list[_Chunk] = []

    def forward(self, hidden: Tensor) -> Tensor:
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, self.keep)
        out = []
        for start in range(0, hidden.shape[0], self.chunk_tokens):
            stop = start + self.chunk_tokens
            chunk = _Chunk(self.head, self.targets[start:stop], self.filters, self.want_entropy, self.orders)
            self.chunks.append(chunk)
            if torch.is_grad_enabled():
                # Keep only the chunk's input for backward: its logits are computed again there.
                out.append(checkpoint(chunk, hidden[start:stop], use_reentrant=False))
            else:
                out.append(chunk(hidden[start:stop]))
        return torch.cat(out)

    def measured(self) -> Tensor:
        """Each kept position's entropy [K], or its log power sums [K, len(orders)]."""
        parts = [chunk.measured for chunk in self.chunks]
        if any(part is None for part in parts):
            raise RuntimeError("neither the entropy nor power sums were asked for in this forward")
        return torch.cat(parts)  # type: ignore[arg-type]


@contextmanager
def _selective_head(
    model, keep: Tensor, targets: Tensor, filters: Filters, entropy: bool, orders: tuple[float, ...] = ()
) -> Iterator[_SelectiveHead]:
    for key in _LOGIT_TRANSFORMS:
        if getattr(model.config, key, None) not in (None, 1, 1.0):
            raise ValueError(
                f"{model.config.model_type} transforms its logits after the LM head ({key}); "
                "echo2's log-probs support models whose logits are the head's output"
            )
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (LM head) to take log-probs from")
    vocab = int(getattr(head, "out_features", None) or model.config.vocab_size)
    selective = _SelectiveHead(head, keep, targets, filters, entropy, orders, vocab)
    model.set_output_embeddings(selective)
    try:
        yield selective
    finally:
        model.set_output_embeddings(head)
