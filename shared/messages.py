"""Every message that crosses the wire between hub, nodes and dashboards, with its protocol id.

Each protocol is request/response on its own stream: the dialer writes one message and
half-closes, the listener answers with one message (snapshot transfers stream frames and
end with an application ack). A joined node's frequent requests may instead share one
long-lived session stream (SESSION_PROTOCOL). Type tags are unique across all messages; binary frames
(snapshot chunks) use tags 200-255 (see shared/wire.py). Size caps are per message type
and checked before the body is read.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from shared.rollout import MAX_ENV_SEGMENTS, MAX_VERSION, Completion, SamplingParams
from shared.staleness import StalenessMove
from shared.units import duration
from shared.wire import Message, protocol_id

JOIN_PROTOCOL = protocol_id("join")
HEARTBEAT_PROTOCOL = protocol_id("heartbeat")
LEASE_PROTOCOL = protocol_id("lease")
SUBMIT_PROTOCOL = protocol_id("submit")
STATUS_PROTOCOL = protocol_id("status")
# Status requests a peer that has not joined may make per address, sustained (after a short burst): the hub
# enforces it, and a remote dashboard polls slower than it.
STRANGER_STATUS_PER_S = 1.0
SNAPSHOT_PROTOCOL = protocol_id("snapshot")
RELAY_PROTOCOL = protocol_id("relay")
REPORT_PROTOCOL = protocol_id("report")
MODEL_PROTOCOL = protocol_id("model")
# Added in a minor step: a hub without it refuses the protocol, and the node keeps the price it joined with.
PRICE_PROTOCOL = protocol_id("price")
# Added in a minor step: one long-lived stream carries a joined node's requests of SESSION_REQUESTS one at a time,
# each a selector byte (the protocol's index there) and then exactly the frame that protocol's own stream carries,
# answered by its reply frame. A stream per request costs the hub ~4x the CPU (negotiation, Yamux open and close:
# bench/p2p.py). A Reject ends the session; a hub without the protocol refuses it, and the node opens a stream per
# request as before.
SESSION_PROTOCOL = protocol_id("session")
# Added in a minor step: a node that stops says so, and its open leases go back to the pool at once instead of
# after heartbeat_timeout_s of silence, while the learner may be waiting for them; it is still dropped at that
# timeout (hub/service/state.py HubState.leave). A hub without it refuses the protocol.
LEAVE_PROTOCOL = protocol_id("leave")
LEFT_REASON = "left: the node stopped"  # the detail of the release a leave brings
# Added in a minor step: before it exits, a hub whose run is over (its last step done, or its operator stopped it)
# tells each joined node so on the node's own connection (RunOver), and the node stops, or waits for the next run if
# its volunteer asked (--wait-next-run), instead of retrying a hub that is not coming back. A node without it refuses
# the protocol and retries, as after a crash; a hub without it never tells, and a hub that crashes cannot.
RUN_OVER_PROTOCOL = protocol_id("run_over")
RUN_OVER_REASON = "left: the run is over"  # the detail of the leave a run's end brings each of its nodes
# Added in a minor step: a node holding a multi-turn lease (Lease.tools) sends its rollouts' model turns (TurnRequest)
# and reads back the environment's tokens to append (TurnReply); on the node's session (SESSION_REQUESTS).
TURN_PROTOCOL = protocol_id("turn")
SESSION_REQUESTS = (HEARTBEAT_PROTOCOL, LEASE_PROTOCOL, SUBMIT_PROTOCOL, PRICE_PROTOCOL, TURN_PROTOCOL)
SESSION_IDLE_S = 120.0  # the hub ends a session that waited this long for its next request
SESSIONS_PER_PEER = 4  # sessions a node may hold open at once; the hub refuses more as busy

KIB = 1024
MIB = 1024 * KIB

# Binary frame tags (bodies are not JSON).
MANIFEST_FRAME = 200
CHUNK_FRAME = 201
MODEL_FILE_FRAME = 202  # the bytes of one model file (MODEL_PROTOCOL)

NodeState = Literal["probing", "active", "standby", "banned", "gone"]
# Whether peers can dial a node: yes, it dials out only (behind a NAT), or not probed yet.
Reachability = Literal["public", "nated", "unknown"]

# Bounds on what a peer may declare. Every number a peer sends is bounded here, before any of our
# code sees it: a version is a learner step (far below SQLite's 64-bit INTEGER), a link between a
# modem and a data-centre NIC, a price below any GPU rental (the hub's own ceiling is lower).
MAX_CHUNKS = 1 << 24
MIN_LINK_BPS = 1e4
MAX_CONTEXT_TOKENS = 1 << 22
MAX_LINK_BPS = 1e12
MAX_PRICE_PER_HOUR = 1000.0
MAX_LISTEN_ADDRS = 8
MAX_STOP_IDS = 64  # EOS ids a model declares (Qwen3 and Llama 3: 2-3)
MAX_TOKEN_ID = 1 << 31
MAX_ADDR_CHARS = 256

# A status file whose writer claims to be running but has not rewritten it for this long
# (it is rewritten about once a second) most likely belongs to a process that died.
STALE_FILE_S = 10.0

_BASE58 = "1-9A-HJ-NP-Za-km-z"
ADDR_PATTERN = rf"^/(ip4|ip6|dns|dns4|dns6)/[A-Za-z0-9.:\-]{{1,200}}/tcp/[0-9]{{1,5}}(/p2p/[{_BASE58}]{{1,128}})?$"
PEER_ID_PATTERN = rf"^[{_BASE58}]{{1,128}}$"


SHORT_ID_CHARS = 8


# Of a node's chosen name, the characters a nodes table shows beside its short id (the full name is up to 32).
LABEL_NAME_CHARS = 16


def short_id(peer_id: str | None) -> str:
    """How every echo2 screen names a peer: the last 8 characters of its id (None: the hub)."""
    return "hub" if peer_id is None else peer_id[-SHORT_ID_CHARS:]


_UNPRINTABLE = ("Cc", "Cf", "Zl", "Zp")


def _printable(text: str) -> str:
    """Free text a peer sends ends up on operators' terminals: no control or formatting characters."""
    if any(unicodedata.category(c) in _UNPRINTABLE for c in text):
        raise ValueError("control or formatting characters are not allowed")
    return text


# A peer's free text (a refusal's reason, a hub's task name) as a node prints and logs it: cleaned and cut to this.
PEER_TEXT_CHARS = 300


def printable_excerpt(text: str, max_chars: int) -> str:
    """A peer's free text fit for one line of a log or a screen: control and formatting characters shown as "?",
    cut to `max_chars` (with "..." when cut). For text already received, where refusing it would lose the rest of
    its message."""
    clean = "".join("?" if unicodedata.category(c) in _UNPRINTABLE else c for c in text[: max_chars + 1])
    return clean if len(clean) <= max_chars else clean[: max(max_chars - 3, 0)] + "..."


Version = Annotated[int, Field(ge=0, le=MAX_VERSION)]
# The longest a hub may tell a node to wait between heartbeats, however large its fleet.
HEARTBEAT_PERIOD_MAX_S = 600.0
HeldVersion = Annotated[int, Field(ge=-1, le=MAX_VERSION, description="newest verified snapshot held (-1: none)")]
ChunkIndex = Annotated[int, Field(ge=0, le=MAX_CHUNKS)]
PrintableText = Annotated[str, AfterValidator(_printable)]
ListenAddr = Annotated[str, Field(max_length=MAX_ADDR_CHARS, pattern=ADDR_PATTERN)]
PeerIdText = Annotated[str, Field(max_length=128, pattern=PEER_ID_PATTERN)]
# A volunteer's display name: printable, no space at either end. Any such text is allowed (markup too), because
# every place that shows it escapes it: the web page sets it as text only, the terminals print it as plain text.
DisplayName = Annotated[str, Field(min_length=1, max_length=32, pattern=r"^\S(.*\S)?$"), AfterValidator(_printable)]


class RejectCode(StrEnum):
    """Why a request was refused, for the program that sent it (the reason text is for people)."""

    BUSY = "busy"  # throttled, or the hub is full: send the same request again later
    BANNED = "banned"  # this identity is banned for good: stop
    MODEL_MISMATCH = "model_mismatch"  # the node runs another model than the hub: restart it with the hub's
    PRICE_TOO_HIGH = "price_too_high"  # the declared price is above the hub's ceiling: join again with a lower one
    UNKNOWN_NODE = "unknown_node"  # not joined (or dropped as silent): join again
    BAD_LEASE = "bad_lease"  # the lease is unknown, expired, answered, or another node's
    NOT_HELD = "not_held"  # the snapshot version asked for is not held here
    NOT_UPSTREAM = "not_upstream"  # a report about a peer that is not the reporter's upstream
    BAD_REQUEST = "bad_request"  # malformed, unsigned, out of bounds: the sender's fault


class Reject(Message):
    """A refusal with its code and reason, sent instead of the expected reply."""

    TYPE: ClassVar[int] = 1
    MAX_BYTES: ClassVar[int] = 4 * KIB
    code: RejectCode
    reason: str = Field(max_length=1000)

    @property
    def busy(self) -> bool:
        """The hub throttled the request (per-peer limits): the same request may be sent again later."""
        return self.code == RejectCode.BUSY


class Tallies(BaseModel):
    """A node's counts of what the hub decided about its work: the one definition behind the store's
    columns, the status messages, `echo-hub status` and both dashboards. `short` is the column header."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    accepted: int = Field(0, ge=0, description="groups accepted", json_schema_extra={"short": "acc"})
    rejected: int = Field(0, ge=0, description="groups refused as bad work", json_schema_extra={"short": "rej"})
    late: int = Field(
        0,
        ge=0,
        description="groups refused only because their version fell out of the staleness window",
        json_schema_extra={"short": "late"},
    )
    refused: int = Field(
        0,
        ge=0,
        description="requests refused at the protocol level (bad frames, expired leases...)",
        json_schema_extra={"short": "ref"},
    )

    def __add__(self, other: Tallies) -> Tallies:
        return Tallies(**{name: getattr(self, name) + getattr(other, name) for name in TALLY_FIELDS})

    @property
    def decided(self) -> int:
        """Groups the hub decided about (every verdict)."""
        return sum(getattr(self, name) for name in GROUP_VERDICTS)


TALLY_FIELDS: tuple[str, ...] = tuple(Tallies.model_fields)
# The tallies that are verdicts on one group each: a group is exactly one of these.
GROUP_VERDICTS: tuple[str, ...] = ("accepted", "rejected", "late")
TALLY_SHORT: dict[str, str] = {
    name: str(f.json_schema_extra["short"]) for name, f in Tallies.model_fields.items() if isinstance(f.json_schema_extra, dict)
}


class GroupReason(StrEnum):
    """Why the hub did not take a group: the words its refusals are counted under in the hub's log, the submit reply,
    `echo-hub status`, both dashboards, /metrics' `reason` label and the node's summary. LATE is the `late` verdict;
    every other one a `rejected` one. The verdict's own text adds the details."""

    LATE = "late"
    LEASE = "lease"
    VERSION = "version"
    TOKENS = "tokens"
    CLAIMED_REWARD = "claimed_reward"
    COPY = "copy"
    REWARD_BUDGET = "reward_budget"
    REWARD_FAILED = "reward_failed"
    ENVIRONMENT = "environment"


# What each reason means, for people (the node's summary and dashboard, `echo-hub status`).
GROUP_REASON_TEXT: dict[GroupReason, str] = {
    GroupReason.LATE: "its version fell out of the hub's staleness window before it arrived (unpaid, not bad work)",
    GroupReason.LEASE: "it does not answer its lease as asked (a prompt not leased or answered twice, another group size)",
    GroupReason.VERSION: "made with a version never published, below the lease's minimum, or several versions",
    GroupReason.TOKENS: "a malformed completion (its length, log-probs, tokens after EOS, ids outside the vocabulary)",
    GroupReason.CLAIMED_REWARD: "the rewards it claimed differ from the hub's scores",
    GroupReason.COPY: "it repeats earlier work at odds honest sampling would not reach in the whole run",
    GroupReason.REWARD_BUDGET: "the task's reward ran past its CPU budget on its text",
    GroupReason.REWARD_FAILED: "the task's reward failed on its text",
    GroupReason.ENVIRONMENT: "its model turns or tool answers differ from those it exchanged with the hub (a cheat's: its node is banned)",
}
MAX_REASONS = 32  # reasons one count may name: GroupReason's, and room for those a newer hub adds
# A reason as it travels: one of GroupReason's values, or a newer hub's, shown as sent (the pattern makes it safe to).
ReasonKey = Annotated[str, Field(pattern=r"^[a-z][a-z_]{0,31}$")]
REASON_COUNT_MAX = 2**53
NEEDED_ROLLOUTS_PER_S_MAX = 1e9  # the pace a late verdict names, at most (a lease answered in no time asks for more)
# The most seconds one lease can be paid for: a lease is paid at most its timeout, which hub.config.LeaseConfig bounds by this.
LEASE_SECONDS_MAX = 86400.0
ReasonCounts = Annotated[dict[ReasonKey, Annotated[int, Field(ge=0, le=REASON_COUNT_MAX)]], Field(max_length=MAX_REASONS)]


def reason_meaning(key: str) -> str:
    """What a reason means, for people; a reason this echo2 does not know (a newer hub's) says so."""
    try:
        return GROUP_REASON_TEXT[GroupReason(key)]
    except ValueError:
        return "a reason this echo2 does not know (the hub runs a newer one)"


def add_reasons(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, int]:
    """Two counts by reason added up, still a ReasonCounts: each count capped, and a reason `a` does not name yet
    kept only while fewer than MAX_REASONS are (replies each within the bounds must not add up past them)."""
    total = {key: min(REASON_COUNT_MAX, n + b.get(key, 0)) for key, n in a.items()}
    for key, n in b.items():
        if key not in total and len(total) < MAX_REASONS:
            total[key] = min(REASON_COUNT_MAX, n)
    return total


def reasons_text(counts: Mapping[str, int]) -> str:
    """Counts by reason in a few words, most first: "tokens 3, late 1" ("-" for none)."""
    named = sorted(((n, key) for key, n in counts.items() if n), key=lambda item: (-item[0], item[1]))
    return ", ".join(f"{key} {n}" for n, key in named) or "-"


class JoinRequest(Message):
    TYPE: ClassVar[int] = 2
    MAX_BYTES: ClassVar[int] = 16 * KIB
    price_per_hour: float = Field(ge=0.0, le=MAX_PRICE_PER_HOUR, description="declared price, $/h")
    hardware: PrintableText = Field(max_length=200, description="free-form hardware summary")
    link_bps: float = Field(ge=MIN_LINK_BPS, le=MAX_LINK_BPS, description="declared link bandwidth, bytes/s")
    backend: Literal["hf", "vllm"]
    model_config_hash: str = Field(max_length=128, pattern=r"^[0-9a-f]{1,128}$")
    dtype: Literal["float32", "bfloat16"] = Field(description="the engine's weight dtype; must be the hub's snapshot dtype")
    version_held: HeldVersion = -1
    listen_addrs: tuple[ListenAddr, ...] = Field((), max_length=MAX_LISTEN_ADDRS, description="where peers can dial this node")
    name: DisplayName | None = Field(None, description="display name on the hub's status page (None: the short peer id)")


class JoinReply(Message):
    TYPE: ClassVar[int] = 3
    MAX_BYTES: ClassVar[int] = 16 * KIB
    state: NodeState
    latest_version: HeldVersion
    staleness: int = Field(ge=0)
    task: str
    heartbeat_period_s: float = Field(gt=0.0, le=HEARTBEAT_PERIOD_MAX_S, description="how often the node must heartbeat")
    context_tokens: int = Field(
        ge=1,
        le=MAX_CONTEXT_TOKENS,
        description="what a lease can need of a model's context: the task's longest prompt plus max_new_tokens (vLLM sizes max_model_len by it)",
    )
    # Protocol 2.6.0 (None: the node keeps its model directory's set).
    stop_ids: tuple[Annotated[int, Field(ge=0, lt=MAX_TOKEN_ID)], ...] | None = Field(
        None,
        min_length=1,
        max_length=MAX_STOP_IDS,
        description="the ids that end a completion: every EOS of the hub's model (shared.model_identity: its stop ids), which its checks accept and nothing else",
    )


# The model's config and tokenizer files a hub offers nodes that bring no model (shared/model_files.py): real
# tokenizers take up to ~20 MB, a config a few KB; weights never travel this way (they come as snapshots).
MODEL_FILE_MAX_BYTES = 32 * MIB
MODEL_FILES_MAX_BYTES = 64 * MIB
MODEL_FILES_MAX_COUNT = 32
# A plain file name: no path separator, no leading dot (hence no ".."), nothing a shell or a file system treats specially.
MODEL_FILE_NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,99}$"


class ModelFile(BaseModel):
    """One file of the hub's model directory: its name, size and blake3 (checked before it is written)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str = Field(max_length=100, pattern=MODEL_FILE_NAME_PATTERN)
    size: int = Field(ge=0, le=MODEL_FILE_MAX_BYTES, description="bytes")
    blake3: str = Field(pattern=r"^[0-9a-f]{64}$")


class ModelFilesRequest(Message):
    """Ask the hub for its model's file list (name None) or for one file's bytes (a MODEL_FILE_FRAME answers)."""

    TYPE: ClassVar[int] = 25
    MAX_BYTES: ClassVar[int] = 1 * KIB
    name: str | None = Field(None, max_length=100, pattern=MODEL_FILE_NAME_PATTERN)


class ModelFiles(Message):
    """The hub's model: what it is (for people) and the files a node needs to build its engine before the
    first snapshot brings the weights."""

    TYPE: ClassVar[int] = 26
    MAX_BYTES: ClassVar[int] = 16 * KIB
    model: PrintableText = Field(
        max_length=300, description="name, architecture and vocabulary, e.g. Qwen3-8B (Qwen3ForCausalLM, vocab 151936)"
    )
    weights_in_snapshots: bool = Field(
        description="False in a LoRA run: snapshots carry adapters only, the node needs the base weights"
    )
    files: tuple[ModelFile, ...] = Field(min_length=1, max_length=MODEL_FILES_MAX_COUNT)
    max_price_per_hour: float | None = Field(
        None,
        ge=0.0,
        le=MAX_PRICE_PER_HOUR,
        description="the hub's price ceiling, $/h: a node asking more is refused at join, so it checks before it builds its engine (None: not said)",
    )

    @model_validator(mode="after")
    def _bounded(self) -> ModelFiles:
        names = [f.name for f in self.files]
        if len(set(names)) != len(names):
            raise ValueError("file names repeat")
        if "config.json" not in names:
            raise ValueError("no config.json")
        if sum(f.size for f in self.files) > MODEL_FILES_MAX_BYTES:
            raise ValueError(f"files total more than MODEL_FILES_MAX_BYTES ({MODEL_FILES_MAX_BYTES})")
        return self


class Heartbeat(Message):
    TYPE: ClassVar[int] = 4
    MAX_BYTES: ClassVar[int] = 4 * KIB
    version_held: HeldVersion
    receiving_version: Version | None = Field(None, description="snapshot in flight, if any")
    chunks_received: ChunkIndex = 0
    punch_failed_with: PeerIdText | None = Field(None, description="the upstream a hole punch with failed")


class HeartbeatReply(Message):
    TYPE: ClassVar[int] = 5
    MAX_BYTES: ClassVar[int] = 16 * KIB
    state: NodeState
    latest_version: HeldVersion
    heartbeat_period_s: float = Field(
        gt=0.0, le=HEARTBEAT_PERIOD_MAX_S, description="when to beat next: longer as the fleet grows"
    )
    upstream: str | None = Field(None, description="peer id this node pulls snapshots from (None: the hub)")
    upstream_addrs: tuple[ListenAddr, ...] = Field((), max_length=MAX_LISTEN_ADDRS)
    downstream: str | None = Field(None, description="peer id that pulls snapshots from this node")
    downstream_addrs: tuple[ListenAddr, ...] = Field(
        (), max_length=MAX_LISTEN_ADDRS, description="dial the downstream at these first: it cannot dial this node"
    )
    chain: int | None = None
    chain_position: int | None = None
    reachability: Reachability = Field("unknown", description="whether peers can dial this node")
    upstream_link: Literal["hub", "direct", "pushed", "holepunch"] = Field(
        "hub", description="how to reach the upstream: dial it, be dialed by it, or hole-punch through the hub's relay"
    )
    rollouts_per_s: float | None = Field(
        None,
        ge=0.0,
        le=NEEDED_ROLLOUTS_PER_S_MAX,
        description="this node's throughput as the hub measured it (None: not yet), which it ranks nodes by (price over it)",
    )
    too_slow: bool = Field(
        False,
        description="every group of its last two leases arrived late: the hub activates it again only once its measured rate changes",
    )


class PriceChange(Message):
    """A joined node re-declares its price: paid for leases issued from now on (bounded as at join)."""

    TYPE: ClassVar[int] = 35
    MAX_BYTES: ClassVar[int] = 1 * KIB
    price_per_hour: float = Field(ge=0.0, le=MAX_PRICE_PER_HOUR, description="new price, $/h")


class PriceReply(Message):
    """The price now in force and how long until the hub takes the next change."""

    TYPE: ClassVar[int] = 36
    MAX_BYTES: ClassVar[int] = 1 * KIB
    price_per_hour: float = Field(ge=0.0, le=MAX_PRICE_PER_HOUR)
    next_change_in_s: float = Field(ge=0.0, le=86400.0, description="a change sooner than this is refused")


class Leave(Message):
    """A joined node stops: take back its open leases and its place in the active pool now."""

    TYPE: ClassVar[int] = 43
    MAX_BYTES: ClassVar[int] = 1 * KIB


class LeaveReply(Message):
    """This many of the node's open leases went back to the pool."""

    TYPE: ClassVar[int] = 44
    MAX_BYTES: ClassVar[int] = 1 * KIB
    leases_released: int = Field(ge=0, le=1_000_000)


class RunOver(Message):
    """The hub's run is over (RUN_OVER_PROTOCOL): the hub sends it to each joined node before it exits."""

    TYPE: ClassVar[int] = 45
    MAX_BYTES: ClassVar[int] = 1 * KIB
    finished: bool = Field(description="it reached its last step (False: its operator stopped it; a start again resumes it)")
    step: int = Field(ge=0, le=MAX_VERSION, description="the learner step it ended at")
    steps: int = Field(ge=0, le=MAX_VERSION, description="the steps it was set to run (0: no limit)")

    def text(self) -> str:
        """What the volunteer reads: "the hub's run finished at step 200 of 200"."""
        at = f"step {self.step} of {self.steps}" if self.steps else f"step {self.step}"
        if self.finished:
            return f"the hub's run finished at {at}"
        return f"the hub's operator stopped its run at {at} (it resumes if started again)"


class RunOverReply(Message):
    """The node heard that the run is over: it stops, or waits for the next run at the hub's address."""

    TYPE: ClassVar[int] = 46
    MAX_BYTES: ClassVar[int] = 1 * KIB
    waits: bool = Field(description="the node waits for the next run (--wait-next-run); False: it stops")


class LeaseRequest(Message):
    TYPE: ClassVar[int] = 6
    MAX_BYTES: ClassVar[int] = 1 * KIB
    version_held: HeldVersion


class LeasePrompt(Message):
    TYPE: ClassVar[int] = 7
    MAX_BYTES: ClassVar[int] = 64 * KIB
    prompt_id: str = Field(max_length=200)
    text: str = Field(max_length=60_000)


class ToolUse(BaseModel):
    """A multi-turn lease's terms: each rollout's model turns go to the hub (TURN_PROTOCOL), which answers with the
    tokens of its tools' or environment's reply, until it says the rollout is done. The lease's
    sampling.max_new_tokens caps a rollout's model and environment tokens together (TRL's max_completion_length)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tool_calls: int = Field(
        ge=1, le=MAX_ENV_SEGMENTS, description="rounds of tool calls a rollout may run (TRL's max_tool_calling_iterations)"
    )


class Lease(Message):
    """Work for one node: answer every prompt with group_size completions, once, before the deadline."""

    TYPE: ClassVar[int] = 8
    MAX_BYTES: ClassVar[int] = 4 * MIB
    lease_id: str = Field(max_length=64)
    prompts: tuple[LeasePrompt, ...] = Field(max_length=4096)
    group_size: int = Field(ge=1, le=256)
    sampling: SamplingParams
    min_version: int = Field(ge=0, description="oldest policy version the hub will still accept")
    deadline_s: float = Field(gt=0.0, description="seconds from issue until the lease expires")
    tools: ToolUse | None = Field(None, description="multi-turn: the rollouts call the hub's tools (None: single-turn)")


# A multi-turn lease's turns (TURN_PROTOCOL). Every number is bounded here, before the hub reads a rollout's key.
TURNS_PER_REQUEST_MAX = 1024  # rollouts' turns one request carries
TURN_TOKENS_MAX = 65536  # a turn's tokens, and a reply's environment tokens per rollout: SamplingParams' max_new_tokens
TOKEN_ID_JSON_BYTES = 11  # a token id below MAX_TOKEN_ID (<= 10 digits) and its comma
TURN_JSON_BYTES = 512  # a turn's or an answer's keys, brackets, prompt id (at its longest, escaped) and index


class RolloutTurn(BaseModel):
    """One rollout's model turn: its token ids as sampled, the stop token included when it stopped on one."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt_id: str = Field(max_length=200)
    index: int = Field(ge=0, lt=256, description="the completion's place in its group (0 .. group_size - 1)")
    token_ids: tuple[Annotated[int, Field(ge=0, lt=MAX_TOKEN_ID)], ...] = Field(min_length=1, max_length=TURN_TOKENS_MAX)


class TurnRequest(Message):
    """The model turns of a lease's rollouts that are not done yet, one per rollout."""

    TYPE: ClassVar[int] = 47
    MAX_BYTES: ClassVar[int] = 16 * MIB
    lease_id: str = Field(max_length=64)
    turns: tuple[RolloutTurn, ...] = Field(min_length=1, max_length=TURNS_PER_REQUEST_MAX)

    @model_validator(mode="after")
    def _one_turn_a_rollout(self) -> TurnRequest:
        if len({(t.prompt_id, t.index) for t in self.turns}) != len(self.turns):
            raise ValueError("two turns of one rollout in one request")
        return self


class RolloutAnswer(BaseModel):
    """What one rollout does next: append `env_ids` and generate again, or stop (`done`; `end`: why it was cut short)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt_id: str = Field(max_length=200)
    index: int = Field(ge=0, lt=256)
    env_ids: tuple[Annotated[int, Field(ge=0, lt=MAX_TOKEN_ID)], ...] = Field((), max_length=TURN_TOKENS_MAX)
    done: bool = False
    end: str | None = Field(None, pattern=r"^[a-z][a-z_]{0,31}$", description="shared.tools.RolloutEnd's value, if any")

    @model_validator(mode="after")
    def _done_or_more(self) -> RolloutAnswer:
        if self.done == bool(self.env_ids):
            raise ValueError("an answer either ends its rollout or carries tokens to append, not both or neither")
        return self


class TurnReply(Message):
    """The answers to a TurnRequest's turns, in its order."""

    TYPE: ClassVar[int] = 48
    MAX_BYTES: ClassVar[int] = 16 * MIB
    answers: tuple[RolloutAnswer, ...] = Field(max_length=TURNS_PER_REQUEST_MAX)


def turns_per_request(max_new_tokens: int) -> int:
    """The most turns one TurnRequest may carry under a lease of `max_new_tokens`: its reply, every answer at the
    rollout's whole budget, must fit TurnReply.MAX_BYTES (the hub refuses a request with more)."""
    answer = TURN_JSON_BYTES + max_new_tokens * TOKEN_ID_JSON_BYTES
    return max(1, min(TURNS_PER_REQUEST_MAX, (TurnReply.MAX_BYTES - TURN_JSON_BYTES) // answer))


class LeaseReply(Message):
    TYPE: ClassVar[int] = 9
    MAX_BYTES: ClassVar[int] = 4 * MIB + 1 * KIB
    lease: Lease | None = None
    retry_after_s: float = Field(0.0, ge=0.0, le=3600.0)
    reason: str = Field("", max_length=500)


class SubmittedGroup(Message):
    TYPE: ClassVar[int] = 10
    MAX_BYTES: ClassVar[int] = 8 * MIB
    prompt_id: str = Field(max_length=200)
    completions: tuple[Completion, ...] = Field(max_length=256)
    claimed_rewards: tuple[float, ...] | None = Field(None, max_length=256, description="node's own scores: compared, never used")


class Submission(Message):
    """Signed by the node: the answer to one lease."""

    TYPE: ClassVar[int] = 11
    MAX_BYTES: ClassVar[int] = 32 * MIB
    lease_id: str = Field(max_length=64)
    node_id: str = Field(max_length=128)
    groups: tuple[SubmittedGroup, ...] = Field(max_length=4096)
    # One round trip per lease instead of two: the reply carries the answer to this lease request.
    next_lease_for: HeldVersion | None = Field(None, description="ask for the next lease in the reply, holding this version")


class SubmitReply(Message):
    TYPE: ClassVar[int] = 12
    MAX_BYTES: ClassVar[int] = 256 * KIB + LeaseReply.MAX_BYTES
    accepted: int = Field(ge=0)
    rejected: tuple[tuple[str, str], ...] = Field((), description="(prompt_id, reason) of groups refused as bad work")
    late: tuple[tuple[str, str], ...] = Field(
        (), description="(prompt_id, reason) of groups whose version fell out of the window"
    )
    paid_usd: float = Field(0.0, ge=0.0, description="what the hub booked for this lease")
    paid_s: float = Field(
        0.0,
        ge=0.0,
        le=LEASE_SECONDS_MAX,
        description="the lease seconds the hub's ledger booked for paid_usd (hub.method.prices.billable_seconds; 0: none booked)",
    )
    reasons: ReasonCounts = Field({}, description="the refused groups (rejected and late) counted by GroupReason")
    needed_rollouts_per_s: float | None = Field(
        None,
        ge=0.0,
        le=NEEDED_ROLLOUTS_PER_S_MAX,
        description="when groups were late: the pace at which this lease would have come back within the window, rollouts/s",
    )
    next_lease: LeaseReply | None = Field(None, description="the answer to the submission's next_lease_for, if it asked")


class StatusRequest(Message):
    TYPE: ClassVar[int] = 13
    MAX_BYTES: ClassVar[int] = 1 * KIB
    events: int = Field(50, ge=0, le=1000, description="recent events wanted")


class NodeStatus(Message):
    TYPE: ClassVar[int] = 14
    MAX_BYTES: ClassVar[int] = 16 * KIB
    peer_id: PeerIdText
    state: NodeState
    price_per_hour: float
    rollouts_per_s: float
    version_held: int
    receiving_version: int | None = None
    chunks_received: int = 0
    tallies: Tallies
    cost_usd: float = Field(description="paid to the node, not voided (from the ledger)")
    backend: Literal["hf", "vllm", ""] = ""
    hardware: PrintableText = Field("", max_length=200)
    chain: int | None = Field(None, description="index of the forwarding chain it sits in")
    chain_position: int | None = None
    reachability: Reachability = Field("unknown", description="public, nated (dials out only) or unknown (not probed yet)")
    link: Literal["", "hub", "direct", "pushed", "holepunch"] = Field(
        "", description="how it gets snapshots: hub, direct (dials its upstream), pushed (dialed by it), holepunch"
    )
    name: DisplayName | Literal[""] = Field("", description="display name the node chose, or its short peer id")
    audits_passed: int = Field(0, ge=0, description="audits of its work the hub re-ran and found honest")
    sampling_nats: float = Field(
        0.0, ge=0.0, le=1e9, description="its sampling test's evidence that it chose its tokens, nats (0: none)"
    )
    price_history: tuple[tuple[float, float], ...] = Field(
        (), max_length=16, description="its latest declared prices, (unix time, $/h), oldest first"
    )
    reasons: ReasonCounts = Field({}, description="its refused groups by GroupReason, since the hub started (operators only)")
    too_slow: bool = Field(
        False, description="every group of its last two leases arrived late: not activated until its measured rate changes"
    )

    def label(self) -> str:
        """How the nodes tables name it: its chosen name (cut to LABEL_NAME_CHARS) and short id, or the short id."""
        short = short_id(self.peer_id)
        if self.name in ("", short):
            return short
        name = self.name if len(self.name) <= LABEL_NAME_CHARS else self.name[: LABEL_NAME_CHARS - 1] + "…"
        return f"{name} {short}"

    def net_text(self) -> str:
        """Reachability and link in a few characters: "nat/push", "pub/direct", "?/hub"."""
        reach = {"public": "pub", "nated": "nat"}.get(self.reachability, "?")
        return f"{reach}/{ {'pushed': 'push', 'holepunch': 'punch'}.get(self.link, self.link) or '-' }"


class StepPoint(Message):
    TYPE: ClassVar[int] = 15
    MAX_BYTES: ClassVar[int] = 4 * KIB
    step: int
    version: int
    reward_mean: float
    staleness_mean: float
    bubble: float
    t_train_s: float
    t_idle_s: float
    tool_calls: float | None = Field(
        None,
        ge=0.0,
        le=MAX_ENV_SEGMENTS,
        description="rounds of tool calls per rollout offered (TRL's tools/call_frequency; None: not a tool-using run)",
    )


class ToolTotals(BaseModel):
    """A tool-using run's tools since the hub started: what the status page, /metrics and the dashboard show."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    calls: int = Field(0, ge=0, le=REASON_COUNT_MAX, description="tool calls the hub ran")
    errors: int = Field(0, ge=0, le=REASON_COUNT_MAX, description="calls the tool refused (it raised): the model reads the error")
    # Reason keys as GroupReason's: a hub's text reaches a dashboard's terminal, so no markup or escape can ride in one.
    ends: dict[ReasonKey, Annotated[int, Field(ge=0, le=REASON_COUNT_MAX)]] = Field(
        {}, max_length=64, description="rollouts ended early, by reason (shared.tools.RolloutEnd)"
    )
    environment_s: float = Field(
        0.0, ge=0.0, le=1e12, description="wall seconds the sandbox spent on tool calls, environments' resets and rewards"
    )
    calls_per_s: float | None = Field(None, ge=0.0, le=1e9, description="tool calls per second over the last minute")


def tool_totals_text(tools: ToolTotals) -> str:
    """The tools' totals in a line: "12,400 calls (8.1/s), 3 errors, ended early: tool_cpu 2, tool_network 1, 41 s in
    the sandbox"."""
    rate = f" ({tools.calls_per_s:.3g}/s)" if tools.calls_per_s is not None else ""
    ends = ", ".join(f"{why} {n}" for why, n in sorted(tools.ends.items())) or "none"
    return (
        f"{tools.calls:,} calls{rate}, {tools.errors:,} errors, ended early: {ends}, {tools.environment_s:.0f} s in the sandbox"
    )


class EvalPoint(Message):
    """One held-out evaluation of the policy after `step` (hub/training/evaluation.py)."""

    TYPE: ClassVar[int] = 23
    MAX_BYTES: ClassVar[int] = 4 * KIB
    step: int
    reward: float
    pass_at_1: float
    pass_at_k: float
    k: int
    prompts: int
    seconds: float = Field(description="how long the evaluation took")

    def as_metrics_row(self) -> dict[str, float | int]:
        """The metrics.jsonl line of this evaluation."""
        return {
            "eval_step": self.step,
            "eval_reward": self.reward,
            "eval_pass_at_1": self.pass_at_1,
            "eval_pass_at_k": self.pass_at_k,
            "eval_k": self.k,
            "eval_prompts": self.prompts,
            "eval_s": self.seconds,
        }


class EventRecord(Message):
    TYPE: ClassVar[int] = 16
    MAX_BYTES: ClassVar[int] = 8 * KIB
    at: float
    kind: str
    node_id: str | None = None
    detail: str = ""


# Warnings for the operator a HubStatus carries at most (the hub keeps shared.logs.OPERATOR_LINES_KEPT).
OPERATOR_WARNINGS_MAX = 50
# The newest of them shown on the dashboard and by `echo-hub status` (the progress line ends with the newest one).
WARNINGS_SHOWN = 3

# The learner steps the rollout reward shown live is averaged over (one step's rollouts are a noisy sample).
RECENT_REWARD_STEPS = 10


class Contribution(Message):
    """A volunteer's accepted work over some span: the leaderboard's figures."""

    TYPE: ClassVar[int] = 41
    MAX_BYTES: ClassVar[int] = 1 * KIB
    accepted: int = Field(0, ge=0, description="groups accepted")
    tokens: int = Field(0, ge=0, description="completion tokens of the accepted groups")
    gpu_hours: float = Field(0.0, ge=0, description="hours of accepted work (a lease's held time, in its accepted share)")
    audits_passed: int = Field(0, ge=0, description="audits of its work the hub re-ran and found honest")


class Leader(Message):
    """One volunteer on the leaderboard."""

    TYPE: ClassVar[int] = 42
    MAX_BYTES: ClassVar[int] = 2 * KIB
    peer_id: PeerIdText
    name: DisplayName = Field(description="display name the node chose, or its short peer id")
    run: Contribution = Field(description="over the whole run")
    day: Contribution = Field(description="over the last 24 hours")


# The status's leaderboard lists the top LEADERS_MAX volunteers of the whole run and of the last day (the hub's status
# board picks them; its web page shows each table's top LEADERS_MAX).
LEADERS_MAX = 100


class HubStatus(Message):
    """What `echo-hub status` and the dashboard show; also written to DATA_DIR/status.json."""

    TYPE: ClassVar[int] = 17
    MAX_BYTES: ClassVar[int] = 8 * MIB
    hub_id: str
    addrs: tuple[str, ...]
    running: bool
    updated_at: float
    step: int
    steps_target: int
    version: int
    staleness: int
    kappa: int
    task: str
    nodes: tuple[NodeStatus, ...]
    chains: tuple[tuple[str, ...], ...] = ()
    broadcast_mode: str = "chain"
    open_leases: int
    totals: Tallies = Field(description="every group received by verdict (local rollouts included), refusals of all nodes")
    dropped_stale: int = Field(description="accepted groups dropped from the buffer as too stale, all-time")
    reasons: ReasonCounts = Field({}, description="refused groups of every node by GroupReason, since the hub started")
    submissions: int = Field(0, ge=0, description="submissions received from nodes, this session")
    heartbeats: int = Field(0, ge=0, description="heartbeats received from nodes, this session")
    audits_passed: int = Field(0, ge=0, description="audits of submissions that passed, this session")
    audits_failed: int = Field(0, ge=0, description="audits that failed (the node was banned), this session")
    audits_unverified: int = Field(0, ge=0, description="audits that could not run (the work was dropped), this session")
    sampling_threshold_nats: float | None = Field(
        None, ge=0.0, le=1e6, description="the sampling test's evidence at which a node is condemned (None: no audits)"
    )
    reward_mean: float | None = None
    t_train_s: float | None = None
    t_bcast_s: float | None = None
    snapshot_bytes: int | None = Field(None, description="bytes of the newest full snapshot")
    delta_bytes: int | None = Field(None, description="bytes of the newest version's delta (None: it went full only)")
    bubble: float | None = None
    predicted_bubble: float | None = None
    mu_pool: float = 0.0
    mu_min: float | None = None
    mu_target: float | None = None
    usable_fraction: float = Field(1.0, description="share of accepted groups the learner trains on (recent window)")
    cost_usd: float = 0.0
    cost_per_step_usd: float | None = None
    all_on_cost_usd: float = 0.0
    history: tuple[StepPoint, ...] = ()
    tools: ToolTotals | None = Field(None, description="a tool-using run's tool calls, errors and time (None: no tools)")
    staleness_moves: tuple[StalenessMove, ...] = Field(
        (), max_length=100, description="S and kappa in force over time, each with why it moved (oldest first, recent ones)"
    )
    evals: tuple[EvalPoint, ...] = Field((), description="held-out evaluations, oldest first (recent ones)")
    events: tuple[EventRecord, ...] = ()
    warnings: tuple[EventRecord, ...] = Field(
        (),
        max_length=OPERATOR_WARNINGS_MAX,
        description="the newest warnings for the operator (stalls, a flat reward, lost steps...), oldest first",
    )
    redacted: bool = Field(False, description="nodes' prices, costs and hardware hidden: asked without an operator key")
    nodes_omitted: int = Field(0, ge=0, description="nodes left out: gone or banned long ago, or past the list's cap")
    leaders: tuple[Leader, ...] = Field(
        (),
        description="the leaderboard: the volunteers with the most accepted groups over "
        "the whole run and over the last day, banned ones left out",
    )

    def recent_reward(self, steps: int = RECENT_REWARD_STEPS) -> tuple[float, int] | None:
        """The rollout reward (every rollout offered, per step) averaged over the last `steps` learner steps of
        the history, and over how many it is (fewer early in a run); None before the first step."""
        points = self.history[-steps:]
        if not points:
            return None
        return sum(p.reward_mean for p in points) / len(points), len(points)

    def recent_reward_text(self, digits: int = 3) -> str:
        """`recent_reward` with what it averages: "0.412 (last 10 steps)"; "-" before the first step."""
        found = self.recent_reward()
        if found is None:
            return "-"
        mean, steps = found
        return f"{mean:.{digits}f} (last {f'{steps} steps' if steps > 1 else 'step'})"

    def recent_tool_calls(self, steps: int = RECENT_REWARD_STEPS) -> float | None:
        """Rounds of tool calls per rollout averaged over the last `steps` learner steps (None: not a tool-using run,
        or before the first step)."""
        points = [p.tool_calls for p in self.history[-steps:] if p.tool_calls is not None]
        return sum(points) / len(points) if points else None

    def newest_warnings(self, limit: int = WARNINGS_SHOWN) -> list[EventRecord]:
        """The newest `limit` warnings for the operator, newest first."""
        return sorted(self.warnings, key=lambda w: w.at, reverse=True)[:limit]

    def broadcast_bytes_text(self) -> str:
        """What one broadcast ships: "snapshot 4.2 MB, delta 0.31 MB (7.4%)"."""
        if self.snapshot_bytes is None:
            return "no snapshot yet"
        text = f"snapshot {self.snapshot_bytes / 1e6:.3g} MB"
        if self.delta_bytes is None:
            return text + ", no delta"
        return text + f", delta {self.delta_bytes / 1e6:.3g} MB ({self.delta_bytes / self.snapshot_bytes:.1%})"

    def redact(self) -> HubStatus:
        """The status a peer without an operator key sees: no node's price, cost or hardware, and events and warnings
        without their details (which name prices, addresses and nodes).

        Nor why a named node's groups were refused (a copy, a false reward claim is an accusation for the operator to
        weigh): strangers see the fleet's counts by reason; a node learns its own from its submit replies.

        The fleet's cost totals go too: with one node on, two reads give its price as
        3600 x (delta all_on - delta cost) / delta t, and quantising would still leak it whenever that node dominates a
        step, so only operators see money."""
        nodes = tuple(
            n.model_copy(update={"price_per_hour": 0.0, "cost_usd": 0.0, "hardware": "", "price_history": (), "reasons": {}})
            for n in self.nodes
        )
        events = tuple(e.model_copy(update={"detail": ""}) for e in self.events)
        warnings = tuple(w.model_copy(update={"detail": ""}) for w in self.warnings)
        return self.model_copy(
            update={
                "nodes": nodes,
                "events": events,
                "warnings": warnings,
                "redacted": True,
                "cost_usd": 0.0,
                "cost_per_step_usd": None,
                "all_on_cost_usd": 0.0,
            }
        )


class SnapshotRequest(Message):
    """Ask the hub (or a holder) for a snapshot, starting at the first chunk the asker lacks."""

    TYPE: ClassVar[int] = 18
    MAX_BYTES: ClassVar[int] = 1 * KIB
    version: Version | None = Field(None, description="None: the newest")
    from_chunk: ChunkIndex = 0
    only_chunk: ChunkIndex | None = Field(None, description="fetch this one chunk only (repair)")
    base_version: Version | None = Field(None, description="the version the asker holds: a delta against it will do")
    bulk: bool = Field(False, description="the asker can take the transfer on the sender's bulk channel (shared/bulk.py)")


class BulkOffer(Message):
    """The answer to a SnapshotRequest with bulk=True: where and how to open the sender's bulk channel.

    No port: the sender runs none, and the transfer follows on the stream that asked."""

    TYPE: ClassVar[int] = 24
    MAX_BYTES: ClassVar[int] = 1 * KIB
    port: int | None = Field(None, ge=1, le=65535, description="TCP port of the channel, at the IP the asker reaches us at")
    ticket: str = Field("", pattern=r"^([0-9a-f]{32})?$", description="one-time ticket the asker sends first (16 bytes, hex)")
    key: str = Field("", pattern=r"^([0-9a-f]{64})?$", description="AES-256-GCM key of this one connection (hex)")

    @model_validator(mode="after")
    def _all_or_nothing(self) -> BulkOffer:
        if (self.port is None) != (self.ticket == "") or (self.port is None) != (self.key == ""):
            raise ValueError("a bulk offer carries a port, a ticket and a key, or none of them")
        return self


class TransferAck(Message):
    """Sent by a receiver after the last frame, so the sender knows everything arrived."""

    TYPE: ClassVar[int] = 19
    MAX_BYTES: ClassVar[int] = 1 * KIB
    version: Version
    chunks: ChunkIndex
    ok: bool
    reason: str = Field("", max_length=500)


class BadChunkReport(Message):
    """A node reports its upstream.

    kind "manifest" or "chunk" (or "delta-manifest", "delta-chunk" of a delta snapshot): `commitment_hex`
    is the upstream's signature over what it sent for
    (version, index) with blake3 `digest_hex` (shared/transfer.py), which the hub checks with the
    upstream's key against its own manifest: proof that bans the upstream, or the reporter if the
    upstream sent the right bytes. kind "unproven": a frame with no valid commitment, or a stall;
    the hub can check nothing, and only moves the upstream to the end of its chain.
    """

    TYPE: ClassVar[int] = 20
    MAX_BYTES: ClassVar[int] = 4 * KIB
    upstream: PeerIdText
    kind: Literal["manifest", "chunk", "delta-manifest", "delta-chunk", "unproven"]
    version: Version
    index: ChunkIndex = 0
    digest_hex: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    commitment_hex: str | None = Field(None, pattern=r"^[0-9a-f]{128}$")
    reason: PrintableText = Field("", max_length=300)


class RelayOffer(Message):
    """First message of a relay stream: which version and from which chunk the sender will stream."""

    TYPE: ClassVar[int] = 21
    MAX_BYTES: ClassVar[int] = 1 * KIB
    version: Version
    from_chunk: ChunkIndex = 0


# A node's time in standby below this goes unsaid: a measured probe passes through it on its way to work.
STANDBY_SAID_S = 1.0
LATE_TEXT = "your groups arrived after the hub moved on"
# Relaying is not paid (docs/volunteers.md "What is paid"): a chain's node forwards the snapshots it receives anyway.
RELAY_UNPAID_TEXT = "unpaid: forwarding what it receives anyway, as every node in a chain does"


def standby_text(price_per_hour: float, measured_rollouts_per_s: float | None, too_slow: bool) -> str:
    """Why a node waits in standby (unpaid), with its measured rate and the hub's rule: it ranks nodes by price per
    measured rollout/s and activates the cheapest that cover the throughput it needs."""
    if not measured_rollouts_per_s:
        return "the hub has not measured your throughput yet (it ranks nodes by price per measured rollout/s)"
    rate = f"{measured_rollouts_per_s:.3g} rollouts/s"
    if too_slow:
        return (
            f"every group of your last two leases arrived late (the hub measured {rate}): it activates you again once your "
            "measured rate changes (a restart of the node measures it again)"
        )
    per_rate = price_per_hour / measured_rollouts_per_s
    return (
        f"the hub ranks nodes by price per measured rollout/s: ${price_per_hour:.2f}/h at {rate} is "
        f"${per_rate:.3g}/h per rollout/s, and nodes cheaper per rollout/s cover the throughput it needs"
    )


class NodeView(Message):
    """A volunteer's own view of its work; the node writes it to DATA_DIR/node_status.json."""

    TYPE: ClassVar[int] = 22
    MAX_BYTES: ClassVar[int] = 256 * KIB
    peer_id: str
    name: str = Field("", max_length=32, description="the display name it joined with (--name; empty: none)")
    hub_addr: str
    connected: bool
    state: NodeState | Literal["connecting"]
    updated_at: float
    price_per_hour: float
    backend: str
    version_held: int
    receiving_version: int | None = None
    chunks_received: int = 0
    chunks_total: int = 0
    chain: int | None = None
    chain_position: int | None = None
    upstream: str | None = None
    downstream: str | None = None
    tokens_per_s: float = 0.0
    rollouts_per_s: float = 0.0
    leases_done: int = 0
    tallies: Tallies = Tallies()
    earnings_usd: float = Field(0.0, description="what the hub booked for this node's leases (as it replied)")
    reasons: ReasonCounts = Field({}, description="its refused groups by GroupReason (as the hub replied)")
    last_refusals: tuple[str, ...] = Field((), max_length=5, description="the hub's newest refusals of its work, in its words")
    needed_rollouts_per_s: float | None = Field(
        None, description="the pace the hub's last late verdict asked for (SubmitReply.needed_rollouts_per_s)"
    )
    standby_s: float = Field(0.0, ge=0.0, description="seconds spent in standby since it started")
    measured_rollouts_per_s: float | None = Field(
        None, ge=0.0, description="its throughput as the hub measured it (HeartbeatReply.rollouts_per_s; None: not yet)"
    )
    too_slow: bool = Field(False, description="the hub holds it in standby: every group of its last two leases arrived late")
    paid_s: float = Field(0.0, ge=0.0, description="lease seconds the hub paid for (SubmitReply.paid_s, as it replied)")
    unanswered: int = Field(
        0, ge=0, description="answers the hub never replied to (lost on the way, or cut off by the stop): maybe paid, not counted"
    )
    run_over: RunOver | None = Field(None, description="the end of the hub's run that stopped this node (None: none did)")

    def unpaid(self) -> list[str]:
        """What went unpaid and why, a line each (the node's exit summary and its dashboard): late groups with the
        pace the hub needs, rejected groups by reason, time in standby."""
        lines = []
        late = self.tallies.late
        if late:
            need = self.needed_rollouts_per_s
            pace = f"this hub needs {need:.3g} rollouts/s per node" if need is not None else "this hub needs a faster node"
            lines.append(
                f"{late} late group{'' if late == 1 else 's'}: {LATE_TEXT}; {pace} "
                f"(this node's last lease ran at {self.rollouts_per_s:.3g})"
            )
        for why, n in sorted(self.reasons.items(), key=lambda item: -item[1]):
            if why != GroupReason.LATE and n:
                lines.append(f"{n} group{'' if n == 1 else 's'} rejected ({why}): {reason_meaning(why)}")
        if self.standby_s >= STANDBY_SAID_S:
            why = standby_text(self.price_per_hour, self.measured_rollouts_per_s, self.too_slow)
            lines.append(f"{duration(self.standby_s)} in standby: {why}")
        return lines

    busy_s: float = 0.0
    versions_installed: int = Field(0, ge=0, description="snapshots installed since this process started")
    relayed_bytes: int = Field(0, ge=0, description="snapshot bytes served to successors (and the hub) since it started")
    events: tuple[EventRecord, ...] = ()
