"""The demo's trace generator and the oracle hit count of one infinite shared cache."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distkv.demo.workload import Request, WorkloadConfig, generate, oracle_hit_tokens
from distkv.replica.harness import block_keys

BLOCK_TOKENS = 16


def small(**kw) -> WorkloadConfig:
    base = dict(requests=60, system_prompts=3, system_tokens=64, user_tokens=24, reply_tokens=8, turns=4, seed=1)
    return WorkloadConfig(**{**base, **kw})


def test_same_seed_same_trace_other_seed_other_trace():
    a, b, c = generate(small()), generate(small()), generate(small(seed=2))
    assert [r.tokens.tolist() for r in a] == [r.tokens.tolist() for r in b]
    assert [r.tokens.tolist() for r in a] != [r.tokens.tolist() for r in c]


def test_conversations_grow_by_reply_and_user_text_and_follow_their_previous_turn():
    config = small()
    trace = generate(config)
    assert len(trace) == config.requests
    turns = [r for r in trace if r.conversation is not None]
    assert len(turns) == round(config.requests * config.conversation_share)
    for i, r in enumerate(trace):
        assert len(r.tokens) <= config.max_prompt_tokens
        assert r.tokens.min() >= 0 and r.tokens.max() < config.vocab_size
        if r.after is None:
            assert r.turn == 0
            assert len(r.tokens) == config.system_tokens + config.user_tokens
            continue
        previous = trace[r.after]
        assert r.after < i and previous.conversation == r.conversation and r.turn == previous.turn + 1
        assert len(r.tokens) == len(previous.tokens) + config.reply_tokens + config.user_tokens
        assert np.array_equal(r.tokens[: len(previous.tokens)], previous.tokens)
    assert max(r.turn for r in turns) == config.turns - 1


def test_every_request_starts_with_its_system_prompt():
    config = small()
    trace = generate(config)
    systems = {}
    for r in trace:
        head = r.tokens[: config.system_tokens].tobytes()
        assert systems.setdefault(r.system_prompt, head) == head
    assert len(set(systems.values())) == config.system_prompts


def test_conversations_only_and_one_off_only():
    assert all(r.conversation is not None for r in generate(small(conversation_share=1.0)))
    assert all(r.conversation is None for r in generate(small(conversation_share=0.0)))


def request(tokens) -> Request:
    return Request(np.asarray(tokens, dtype=np.int32), 0, None, 0, None)


def test_oracle_counts_the_longest_seen_prefix_of_full_blocks():
    a = np.arange(48)  # 3 blocks
    trace = [
        request(a),  # nothing seen: 0
        request(np.concatenate([a, np.arange(100, 120)])),  # 3 blocks seen, the rest new: 48
        request(np.concatenate([a[:16], np.arange(200, 232)])),  # first block only: 16
        request(np.concatenate([np.arange(300, 316), a])),  # a different first block: 0
        request(a[:40]),  # 2 full blocks, both seen: 32
    ]
    assert oracle_hit_tokens(trace, BLOCK_TOKENS) == 48 + 16 + 32


def test_oracle_of_a_generated_trace_is_total_blocks_less_distinct_blocks():
    trace = generate(small(requests=80))
    keys = [block_keys(r.tokens, BLOCK_TOKENS) for r in trace]
    total = sum(len(k) for k in keys)
    distinct = len({key for k in keys for key in k})
    assert oracle_hit_tokens(trace, BLOCK_TOKENS) == (total - distinct) * BLOCK_TOKENS > 0


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), order_seed=st.integers(0, 2**16))
def test_oracle_does_not_depend_on_the_order(seed, order_seed):
    """Prefix keys chain, so an infinite cache misses each distinct block exactly once."""
    trace = generate(small(requests=30, seed=seed))
    shuffled = [trace[i] for i in np.random.default_rng(order_seed).permutation(len(trace))]
    assert oracle_hit_tokens(shuffled, BLOCK_TOKENS) == oracle_hit_tokens(trace, BLOCK_TOKENS)


def test_oracle_as_run_counts_only_blocks_answered_before_a_request_started():
    a = np.arange(48)
    trace = [request(a), request(np.concatenate([a, np.arange(100, 116)])), request(a[:32])]
    # (started, answered): 1 starts while 0 computes; 2 starts once 1 is answered, 0 still computing
    times = [(0.0, 3.0), (0.5, 1.0), (2.0, 2.5)]
    # 1 hits nothing; 2 the 2 blocks 1 computed; 0 nothing, though 1 was answered first
    assert oracle_hit_tokens(trace, BLOCK_TOKENS, times) == 32
    one_at_a_time = [(0.0, 1.0), (1.5, 2.0), (2.5, 3.0)]
    assert oracle_hit_tokens(trace, BLOCK_TOKENS, one_at_a_time) == oracle_hit_tokens(trace, BLOCK_TOKENS) == 48 + 32
    all_at_once = [(0.0, 1.0)] * 3
    assert oracle_hit_tokens(trace, BLOCK_TOKENS, all_at_once) == 0


def test_oracle_as_run_needs_each_requests_times():
    with pytest.raises(ValueError, match="times has 1 requests' times, the trace 2 requests"):
        oracle_hit_tokens([request(np.arange(16))] * 2, BLOCK_TOKENS, [(0.0, 1.0)])


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="turns"):
        WorkloadConfig(turns=0)
    with pytest.raises(ValueError, match="conversation_share"):
        WorkloadConfig(conversation_share=1.5)
