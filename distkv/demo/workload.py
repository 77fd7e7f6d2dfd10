"""The demo's trace: multi-turn conversations and one-off requests behind shared system prompts.

Every request starts with one of a few system prompts, drawn uniformly or, with `skew` s > 0,
from a Zipf distribution (prompt i with weight 1 / (i + 1)^s), so that one prefix is hot. A conversation's next turn is its
previous prompt, the reply to it and new user text; a one-off request is a system prompt
and user text. Conversations and one-off requests are interleaved at random (a
conversation's turns in order), and a cache-unaware router spreads them over the
replicas, so most prefixes a request could reuse were computed on another replica.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from distkv.replica.harness import block_keys


@dataclass(frozen=True)
class WorkloadConfig:
    requests: int = 200
    system_prompts: int = 4
    system_tokens: int = 512
    user_tokens: int = 64  # new user text per request
    reply_tokens: int = 32  # the reply a conversation's next turn carries
    turns: int = 4  # per conversation
    conversation_share: float = 0.6  # of the requests, those that are conversation turns
    vocab_size: int = 4096
    seed: int = 0
    skew: float = 0.0  # Zipf exponent of the system prompts' popularity; 0: uniform

    def __post_init__(self) -> None:
        for name in ("requests", "system_prompts", "system_tokens", "user_tokens", "turns", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"workload {name}={getattr(self, name)} must be positive")
        if self.reply_tokens < 0:
            raise ValueError(f"workload reply_tokens={self.reply_tokens} must not be negative")
        if not 0 <= self.skew < 100:
            raise ValueError(f"workload skew={self.skew} must be in [0, 100)")
        if not 0 <= self.conversation_share <= 1:
            raise ValueError(f"workload conversation_share={self.conversation_share} must be in [0, 1]")

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt: a conversation's last turn."""
        return self.system_tokens + self.turns * self.user_tokens + (self.turns - 1) * self.reply_tokens


@dataclass(frozen=True)
class Request:
    tokens: np.ndarray
    system_prompt: int
    conversation: int | None  # None for a one-off request
    turn: int
    after: int | None  # index of the request (the previous turn) it must follow


def generate(config: WorkloadConfig) -> list[Request]:
    """The trace, in the order requests are sent; the same for the same config."""
    rng = np.random.default_rng(config.seed)

    def text(n: int) -> np.ndarray:
        return rng.integers(0, config.vocab_size, n, dtype=np.int32)

    systems = [text(config.system_tokens) for _ in range(config.system_prompts)]
    turns_total = round(config.requests * config.conversation_share)
    conversations = -(-turns_total // config.turns)
    # A random interleaving: each conversation's slots are its turns, in order.
    slots = np.array([c for c in range(conversations) for _ in range(config.turns)][:turns_total]
                     + [-1] * (config.requests - turns_total))
    rng.shuffle(slots)
    weights = 1.0 / np.arange(1, config.system_prompts + 1) ** config.skew
    popularity = weights / weights.sum()

    def system_prompts(n: int | None = None):
        # uniform draws as before skew existed, so that the default trace stays the same
        if config.skew:
            return rng.choice(config.system_prompts, n, p=popularity)
        return rng.integers(0, config.system_prompts, n)

    conversation_system = system_prompts(conversations)
    last: dict[int, tuple[int, np.ndarray, int]] = {}  # conversation -> (index, prompt, turn)
    trace = []
    for i, c in enumerate(slots.tolist()):
        if c < 0:
            s = int(system_prompts())
            trace.append(Request(np.concatenate([systems[s], text(config.user_tokens)]), s, None, 0, None))
            continue
        s = int(conversation_system[c])
        if c in last:
            previous, prompt, turn = last[c]
            tokens = np.concatenate([prompt, text(config.reply_tokens), text(config.user_tokens)])
            request = Request(tokens, s, c, turn + 1, previous)
        else:
            request = Request(np.concatenate([systems[s], text(config.user_tokens)]), s, c, 0, None)
        last[c] = (i, request.tokens, request.turn)
        trace.append(request)
    return trace


def oracle_hit_tokens(
    trace: Sequence[Request], block_tokens: int, times: Sequence[tuple[float, float]] | None = None
) -> int:
    """Prompt tokens one infinite cache shared by every replica would serve on this trace.

    Each request hits its longest prefix of full blocks that a request answered before it
    started computed. `times`: each request's (start, answer) in a run, in trace order; by
    default each starts once the one before it is answered: the most any cache serves.
    """
    if times is None:
        times = [(i, i) for i in range(len(trace))]
    if len(times) != len(trace):
        raise ValueError(f"times has {len(times)} requests' times, the trace {len(trace)} requests")
    keys = [block_keys(r.tokens, block_tokens) for r in trace]
    answered: dict[bytes, float] = {}  # block -> when the first request that computed it was answered
    for request_keys, (_, answered_at) in zip(keys, times):
        for key in request_keys:
            answered[key] = min(answered.get(key, answered_at), answered_at)
    hits = 0
    for request_keys, (started_at, _) in zip(keys, times):
        hit = 0
        while hit < len(request_keys) and answered[request_keys[hit]] < started_at:
            hit += 1
        hits += hit * block_tokens
    return hits
