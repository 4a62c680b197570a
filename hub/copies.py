"""Copy detection: the same group of completions submitted twice, for different leases or prompts.

A node that replays work it (or another identity) already submitted is paid for sampling it
never did. The detector keeps a bounded LRU of fingerprints of recent accepted groups and flags
a group whose fingerprint it has already seen under another (lease, prompt).

What is legitimately identical: prompts are drawn with replacement, so the same prompt text
reaches several nodes, and on a small, peaked policy identical completions are common (a
confident model answers "olleh<eos>" eight times out of eight, with log-probs near 0). Two
honest groups coincide with probability P = multinomial(n; counts) * prod_j p(c_j), where
p(c_j) = exp(sum of c_j's sampling log-probs): the chance that an independent sampler redraws
this multiset of completions. The rule: a repeat of the same prompt text is flagged only when
P < exp(-copy_min_surprise_nats) (default e^-20 ~ 2e-9 per pair), so whole low-entropy groups
(all completions identical, near-certain tokens) are not flagged while a group with real
sampling randomness in it is. A repeat under another prompt text is always flagged: the
log-probs are conditioned on the prompt, so the same exact floats cannot come from sampling
another prompt.

The fingerprint is blake3 over the sorted per-completion digests of (token ids, exact float64
log-probs): independent of completion order (a copier gains nothing by shuffling), of the
prompt (a group copied onto another prompt is still a copy) and of the claimed version.
A copier that also rewrites the log-probs changes the fingerprint but then lies about
log-probs, which the audits catch.
"""

from __future__ import annotations

import math
import struct
from collections import Counter, OrderedDict
from dataclasses import dataclass

import blake3

from shared.rollout import Group

DIGEST_BYTES = 16


def completion_digest(token_ids: tuple[int, ...], logprobs: tuple[float, ...]) -> bytes:
    n = len(token_ids)
    packed = struct.pack(f"<I{n}q{len(logprobs)}d", n, *token_ids, *logprobs)
    return blake3.blake3(packed).digest(length=DIGEST_BYTES)


def group_fingerprint(group: Group) -> bytes:
    """Order-independent digest of a group's completions (tokens and exact log-probs)."""
    digests = sorted(completion_digest(c.token_ids, c.logprobs) for c in group.completions)
    return blake3.blake3(b"".join(digests)).digest(length=DIGEST_BYTES)


def coincidence_log_prob(group: Group) -> float:
    """log P that an independent honest sampler draws this same multiset of completions (see module doc)."""
    counts = Counter((c.token_ids, c.logprobs) for c in group.completions)
    log_multinomial = math.lgamma(len(group.completions) + 1) - sum(math.lgamma(m + 1) for m in counts.values())
    return log_multinomial + sum(sum(c.logprobs) for c in group.completions)


@dataclass(frozen=True)
class Origin:
    node_id: str
    lease_id: str
    prompt_id: str
    prompt_text: str


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


class CopyDetector:
    """Bounded LRU of recent group fingerprints; `check` every accepted group once."""

    def __init__(self, capacity: int, min_surprise_nats: float) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.min_surprise_nats = min_surprise_nats
        self._seen: OrderedDict[bytes, Origin] = OrderedDict()
        self.checked = 0
        self.probable = 0
        self.flagged = 0

    def __len__(self) -> int:
        return len(self._seen)

    def check(self, group: Group, node_id: str, lease_id: str) -> CopyFlag | None:
        """A CopyFlag if this group repeats one seen under another (lease, prompt); remembers it otherwise."""
        self.checked += 1
        surprise = -coincidence_log_prob(group)
        key = group_fingerprint(group)
        here = Origin(node_id, lease_id, group.prompt_id, group.prompt_text)
        first = self._seen.get(key)
        if first is not None and (first.lease_id, first.prompt_id) != (here.lease_id, here.prompt_id):
            self._seen.move_to_end(key)
            # Log-probs are conditioned on the prompt: the same exact floats under another prompt
            # text were not sampled there, however likely the tokens themselves were.
            if first.prompt_text != here.prompt_text or surprise >= self.min_surprise_nats:
                self.flagged += 1
                return CopyFlag(key.hex(), first, here, surprise)
            self.probable += 1
            return None
        self._seen[key] = here
        self._seen.move_to_end(key)
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
        return None
