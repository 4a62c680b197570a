"""Copy detection: the same group of completions submitted twice, for different leases or prompts.

A node that replays work it (or another identity) already submitted is paid for sampling it
never did. The detector keeps a bounded LRU of fingerprints of recent accepted groups and flags
a group whose fingerprint it has already seen under another (lease, prompt).

The fingerprint is blake3 over the sorted per-completion digests of the token ids alone:
independent of completion order (a copier gains nothing by shuffling), of the prompt (a group
copied onto another prompt is still a copy), of the claimed version, and of the log-probs, so
nudging a log-prob (which audits cannot tell from bf16 noise) changes nothing.

What is legitimately identical: prompts are drawn with replacement, so the same prompt text
reaches several nodes, and on a small, peaked policy identical completions are common (a
confident model answers "olleh<eos>" eight times out of eight, with log-probs near 0). Two
honest groups coincide with probability P = multinomial(n; counts) * prod_j p(c_j), where
p(c_j) = exp(sum of c_j's sampling log-probs): the chance that an independent sampler redraws
this multiset of completions. The rules:
- same prompt text: flagged when P < exp(-copy_min_surprise_nats) (default e^-20 ~ 2e-9 per pair),
  so whole low-entropy groups are not flagged while a group with real sampling randomness is;
- another prompt text: log-probs are conditioned on the prompt, so an honest sampler of the other
  prompt reports other log-probs for the same tokens. Flagged when every completion's log-prob sum
  is within `logprob_tolerance_nats` per token of the first sighting's and P < exp(-CROSS_PROMPT_MIN_SURPRISE_NATS).
  A copier that shifts its log-probs by more than the tolerance (set to the audit tolerance)
  lies by more than audits let pass; one that copies near-certain groups gains little (an honest
  node would have produced them), and the audit of their log-probs under the new prompt still applies.
"""

from __future__ import annotations

import math
import struct
import sys
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import blake3

from shared.rollout import Completion, Group

DIGEST_BYTES = 16
SUM_BYTES = 12  # a completion's token count (uint32) and log-prob sum (float64), packed in an Origin
# A cross-prompt repeat with matching log-probs is flagged only if an honest redraw had odds below e^-this.
CROSS_PROMPT_MIN_SURPRISE_NATS = 3.0


def completion_digest(token_ids: tuple[int, ...]) -> bytes:
    packed = struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids)
    return blake3.blake3(packed).digest(length=DIGEST_BYTES)


def _in_digest_order(group: Group) -> list[Completion]:
    return sorted(group.completions, key=lambda c: completion_digest(c.token_ids))


def group_fingerprint(group: Group) -> bytes:
    """Order-independent digest of a group's completions' token ids."""
    return blake3.blake3(b"".join(completion_digest(c.token_ids) for c in _in_digest_order(group))).digest(length=DIGEST_BYTES)


def coincidence_log_prob(group: Group) -> float:
    """log P that an independent honest sampler draws this same multiset of completions (see module doc)."""
    counts = Counter(c.token_ids for c in group.completions)
    log_multinomial = math.lgamma(len(group.completions) + 1) - sum(math.lgamma(m + 1) for m in counts.values())
    return log_multinomial + sum(sum(c.logprobs) for c in group.completions)


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a group was first seen, kept small: the detector holds up to copy_cache_groups of them (~0.4 KB each)."""

    node_id: str
    lease_id: str
    prompt_id: str
    prompt_digest: bytes  # of the prompt text: only its equality is asked
    # Per completion, in digest order: its token count, then the sum of its reported log-probs (pack_sums).
    packed_sums: bytes = b""

    @property
    def logprob_sums(self) -> list[tuple[int, float]]:
        n = len(self.packed_sums) // SUM_BYTES
        values = struct.unpack(f"<{n}I{n}d", self.packed_sums)
        return list(zip(values[:n], values[n:]))


def pack_sums(sums: Sequence[tuple[int, float]]) -> bytes:
    return struct.pack(f"<{len(sums)}I{len(sums)}d", *(n for n, _ in sums), *(s for _, s in sums))


def prompt_digest(text: str) -> bytes:
    return blake3.blake3(text.encode("utf-8", "surrogatepass")).digest(length=DIGEST_BYTES)


@dataclass(frozen=True)
class CopyFlag:
    """A group seen before: who submitted it first, who again, and how unlikely an honest repeat was."""

    fingerprint: str
    first: Origin
    again: Origin
    surprise_nats: float

    @property
    def same_node(self) -> bool:
        return self.first.node_id == self.again.node_id

    def describe(self) -> str:
        who = "its own" if self.same_node else f"{self.first.node_id}'s"
        return (f"group for {self.again.prompt_id} (lease {self.again.lease_id[:8]}) repeats {who} group for "
                f"{self.first.prompt_id} (lease {self.first.lease_id[:8]}); honest odds e^-{self.surprise_nats:.0f}")


def same_logprobs(a: Origin, b: Origin, tolerance_nats: float) -> bool:
    """Every completion's log-prob sum within `tolerance_nats` per token of the other's."""
    return len(a.packed_sums) == len(b.packed_sums) and all(
        abs(sa - sb) <= tolerance_nats * max(1, n) for (n, sa), (_, sb) in zip(a.logprob_sums, b.logprob_sums)
    )


class CopyDetector:
    """Bounded LRU of recent group fingerprints; `check` every accepted group once."""

    def __init__(self, capacity: int, min_surprise_nats: float, logprob_tolerance_nats: float) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.min_surprise_nats = min_surprise_nats
        self.logprob_tolerance_nats = logprob_tolerance_nats
        self._seen: OrderedDict[bytes, Origin] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def check(self, group: Group, node_id: str, lease_id: str) -> CopyFlag | None:
        """A CopyFlag if this group repeats one seen under another (lease, prompt); remembers it otherwise."""
        surprise = -coincidence_log_prob(group)
        key = group_fingerprint(group)
        sums = tuple((len(c.token_ids), math.fsum(c.logprobs)) for c in _in_digest_order(group))
        # Interned: a node's id, and a lease's, repeat across the groups kept.
        here = Origin(sys.intern(node_id), sys.intern(lease_id), group.prompt_id, prompt_digest(group.prompt_text),
                      pack_sums(sums))
        first = self._seen.get(key)
        if first is not None and (first.lease_id, first.prompt_id) != (here.lease_id, here.prompt_id):
            self._seen.move_to_end(key)
            # The odds of an honest repeat, by the log-probs of whichever sighting makes it less likely: a
            # copier cannot make its copy look likely by reporting log-probs near 0 for it.
            log_multinomial = -surprise - math.fsum(s for _, s in sums)
            surprise = max(surprise, -(log_multinomial + math.fsum(s for _, s in first.logprob_sums)))
            if first.prompt_digest == here.prompt_digest:
                copied = surprise >= self.min_surprise_nats
            else:
                # Log-probs are conditioned on the prompt: the same ones under another prompt text were
                # not sampled there (unless the tokens were near-certain anyway).
                copied = surprise >= CROSS_PROMPT_MIN_SURPRISE_NATS and same_logprobs(
                    first, here, self.logprob_tolerance_nats)
            if copied:
                return CopyFlag(key.hex(), first, here, surprise)
            return None
        self._seen[key] = here
        self._seen.move_to_end(key)
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
        return None
