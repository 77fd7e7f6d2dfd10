"""The demo's model: prefilling on top of cached K/V gives what prefilling in one go gives."""

import numpy as np
import pytest
import torch
import xxhash

from distkv.demo.model import ModelConfig, PagedKV, TinyDecoder, prefill

BLOCK_TOKENS = 8
CONFIG = ModelConfig(vocab_size=512, dim=64, layers=2, heads=4, seed=3)


def make_cache(num_blocks: int = 16) -> PagedKV:
    page = CONFIG.page_bytes(BLOCK_TOKENS)
    return PagedKV(
        torch.zeros(num_blocks, page, dtype=torch.int8), torch.zeros(num_blocks, page, dtype=torch.int8), CONFIG, BLOCK_TOKENS
    )


def prompt(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, CONFIG.vocab_size, n)


@pytest.fixture(scope="module")
def model() -> TinyDecoder:
    return TinyDecoder(CONFIG)


def test_same_seed_same_model():
    a, b = TinyDecoder(CONFIG), TinyDecoder(CONFIG)
    assert torch.equal(a.wqkv, b.wqkv) and torch.equal(a.embed, b.embed)
    assert not torch.equal(a.wqkv, TinyDecoder(ModelConfig(vocab_size=512, dim=64, layers=2, heads=4, seed=4)).wqkv)


@pytest.mark.parametrize("length, hit_blocks", [(61, 3), (61, 7), (64, 8), (64, 5), (20, 1)])
def test_suffix_on_cached_prefix_matches_prefill_in_one_go(model, length, hit_blocks):
    tokens = prompt(length, seed=length)
    blocks = np.arange(length // BLOCK_TOKENS)
    whole = make_cache()
    first = prefill(model, whole, tokens, blocks, 0)

    # another replica's cache: the prefix blocks loaded (as distkv would), in other blocks
    other = make_cache()
    mine = blocks[::-1] + 4
    other.k[mine[:hit_blocks]] = whole.k[blocks[:hit_blocks]]
    other.v[mine[:hit_blocks]] = whole.v[blocks[:hit_blocks]]
    assert prefill(model, other, tokens, mine, hit_blocks) == first
    torch.testing.assert_close(other.k[mine], whole.k[blocks], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(other.v[mine], whole.v[blocks], rtol=1e-4, atol=1e-5)


def test_cached_prefix_is_attended_to(model):
    """The suffix's K/V depend on the cached prefix (past layer 0): it is really attended to."""
    tokens = prompt(64, seed=1)
    blocks = np.arange(8)
    right = make_cache()
    prefill(model, right, tokens, blocks, 0)
    wrong = make_cache()
    _, k, v = model.forward(torch.as_tensor(prompt(48, seed=2)), 0)
    wrong.write(torch.arange(6), k, v)
    prefill(model, wrong, tokens, blocks, 6)
    assert torch.equal(wrong.k[6:8, 0], right.k[6:8, 0])  # layer 0 sees only its own tokens
    assert not torch.allclose(wrong.k[6:8, 1:], right.k[6:8, 1:])


def test_write_then_read_round_trips_and_digests_cover_the_pages(model):
    page = CONFIG.page_bytes(BLOCK_TOKENS)
    k_pages, v_pages = torch.zeros(16, page, dtype=torch.int8), torch.zeros(16, page, dtype=torch.int8)
    cache = PagedKV(k_pages, v_pages, CONFIG, BLOCK_TOKENS)
    _, k, v = model.forward(torch.as_tensor(prompt(24)), 0)
    ids = torch.tensor([5, 2, 9])
    cache.write(ids, k, v)
    rk, rv = cache.read(ids, 20)
    assert torch.equal(rk, k[:, :20]) and torch.equal(rv, v[:, :20])
    assert k_pages[[0, 1, 3]].count_nonzero() == 0  # the other blocks are untouched
    assert cache.digests(np.array([2, 9])) == [
        xxhash.xxh3_64(k_pages[b].numpy().tobytes() + v_pages[b].numpy().tobytes()).intdigest() for b in (2, 9)
    ]


def test_bad_input_is_refused(model):
    cache = make_cache()
    with pytest.raises(ValueError, match="blocks"):
        prefill(model, cache, prompt(40), np.arange(4), 0)  # 40 tokens fill 5 blocks
    with pytest.raises(ValueError, match="empty"):
        prefill(model, cache, prompt(0), np.arange(0), 0)
    with pytest.raises(ValueError, match="heads"):
        ModelConfig(dim=60, heads=4)
    with pytest.raises(ValueError, match="pages"):
        PagedKV(torch.zeros(2, 100, dtype=torch.int8), torch.zeros(2, 100, dtype=torch.int8), CONFIG, BLOCK_TOKENS)
