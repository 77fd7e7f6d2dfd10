"""A small decoder-only transformer whose KV cache is paged in distkv's block layout.

The weights are drawn from a seeded generator, so every replica holds the same model.
The KV cache is the replica's pair of KV tensors, each (num_blocks, page_bytes) int8:
block b's K page holds the K of every layer for its block_tokens tokens, as float32
(layers, block_tokens, heads, head_dim), and likewise its V page. A prefill reads the K/V
of the prefix blocks already in the cache (loaded through distkv) and computes only the
rest of the prompt, attending to them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
import xxhash

from distkv.storage.pool import page_align

_FLOAT = torch.float32


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 4096
    dim: int = 256
    layers: int = 4
    heads: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "layers", "heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"model {name}={getattr(self, name)} must be positive")
        if self.dim % self.heads or (self.dim // self.heads) % 2:
            raise ValueError(
                f"model dim={self.dim} must split into {self.heads} heads of an even size (rotary embeddings)"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def kv_bytes(self, block_tokens: int) -> int:
        """Bytes of K (or of V) of one block: every layer's, for its tokens."""
        return self.layers * block_tokens * self.dim * _FLOAT.itemsize

    def page_bytes(self, block_tokens: int) -> int:
        """A block's K (or V) page, padded to whole memory pages as pool slots are."""
        return page_align(self.kv_bytes(block_tokens))


class TinyDecoder:
    """Pre-norm transformer: rotary attention and a SiLU MLP per layer, tied embeddings."""

    def __init__(self, config: ModelConfig, device: str | torch.device = "cpu"):
        self.config = config
        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(config.seed)
        d, layers = config.dim, config.layers

        def weight(*shape: int, fan_in: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen, dtype=_FLOAT) / math.sqrt(fan_in)).to(self.device)

        self.embed = weight(config.vocab_size, d, fan_in=1)
        self.wqkv = weight(layers, d, 3 * d, fan_in=d)
        self.wo = weight(layers, d, d, fan_in=d)
        self.w_up = weight(layers, d, 4 * d, fan_in=d)
        self.w_down = weight(layers, 4 * d, d, fan_in=4 * d)
        half = config.head_dim // 2
        self._inv_freq = (1.0 / 10000 ** (torch.arange(half, dtype=_FLOAT) / half)).to(self.device)

    @torch.inference_mode()
    def forward(
        self, tokens: torch.Tensor, start: int, past_k: torch.Tensor | None = None, past_v: torch.Tensor | None = None
    ) -> tuple[int, torch.Tensor, torch.Tensor]:
        """Prefill tokens at positions start.. on top of the K/V of positions 0..start-1.

        past_k, past_v: (layers, start, heads, head_dim). Returns the greedy next token
        and the K/V of the tokens, (layers, len(tokens), heads, head_dim) each.
        """
        c = self.config
        m = len(tokens)
        if past_k is None:
            if start:
                raise ValueError(f"prefill from position {start} needs the K/V of the {start} before it")
            past_k = past_v = torch.empty(c.layers, 0, c.heads, c.head_dim, dtype=_FLOAT, device=self.device)
        positions = torch.arange(start, start + m, device=self.device)
        angles = positions[:, None].to(_FLOAT) * self._inv_freq
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        keys_seen = torch.arange(start + m, device=self.device)
        mask = keys_seen[None, :] <= positions[:, None]  # causal, over the past and these tokens
        x = self.embed[tokens]
        ks, vs = [], []
        for layer in range(c.layers):
            q, k, v = (_rms_norm(x) @ self.wqkv[layer]).view(m, 3, c.heads, c.head_dim).unbind(1)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            ks.append(k)
            vs.append(v)
            keys = torch.cat([past_k[layer], k]).transpose(0, 1)
            values = torch.cat([past_v[layer], v]).transpose(0, 1)
            attn = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask)
            x = x + attn.transpose(0, 1).reshape(m, c.dim) @ self.wo[layer]
            x = x + F.silu(_rms_norm(x) @ self.w_up[layer]) @ self.w_down[layer]
        logits = _rms_norm(x[-1]) @ self.embed.T
        return int(logits.argmax()), torch.stack(ks), torch.stack(vs)


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class PagedKV:
    """The model's view of a replica's KV tensors: K and V pages per block."""

    def __init__(self, k_pages: torch.Tensor, v_pages: torch.Tensor, config: ModelConfig, block_tokens: int):
        page_bytes = config.page_bytes(block_tokens)
        for name, t in (("K", k_pages), ("V", v_pages)):
            if t.dtype != torch.int8 or t.ndim != 2 or t.shape[1] != page_bytes:
                raise ValueError(
                    f"{name} pages must be (num_blocks, {page_bytes}) int8, got {tuple(t.shape)} {t.dtype}"
                )
        self.config = config
        self.block_tokens = block_tokens
        self._pages = (k_pages, v_pages)
        used = config.kv_bytes(block_tokens) // _FLOAT.itemsize
        shape = (k_pages.shape[0], config.layers, block_tokens, config.heads, config.head_dim)
        self.k, self.v = (t.view(_FLOAT)[:, :used].view(shape) for t in self._pages)

    def read(self, blocks: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the first `tokens` tokens held in blocks: (layers, tokens, heads, head_dim) each."""
        c = self.config
        return tuple(
            t[blocks].transpose(0, 1).reshape(c.layers, -1, c.heads, c.head_dim)[:, :tokens] for t in (self.k, self.v)
        )

    def write(self, blocks: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Fill blocks with the K/V of len(blocks) * block_tokens consecutive tokens."""
        c = self.config
        shape = (c.layers, len(blocks), self.block_tokens, c.heads, c.head_dim)
        self.k[blocks] = k.reshape(shape).transpose(0, 1)
        self.v[blocks] = v.reshape(shape).transpose(0, 1)

    def digests(self, blocks: np.ndarray) -> list[int]:
        """xxh3-64 of each block's K page then V page: the bytes distkv stores for it."""
        index = torch.as_tensor(blocks, dtype=torch.long, device=self._pages[0].device)
        k, v = (t[index].cpu().numpy() for t in self._pages)
        out = []
        for kb, vb in zip(k, v):
            h = xxhash.xxh3_64(kb)
            h.update(vb)
            out.append(h.intdigest())
        return out


def prefill(model: TinyDecoder, cache: PagedKV, tokens: np.ndarray, blocks: np.ndarray, hit_blocks: int) -> int:
    """Compute a prompt whose first hit_blocks full blocks are in the cache already.

    blocks: the cache blocks of the prompt's full blocks, in order. Writes the K/V of the
    full blocks past the hits into theirs; returns the first generated token. When every
    token is cached, the last one is computed again for its logits (its K/V is not rewritten).
    """
    n = len(tokens)
    if n == 0:
        raise ValueError("empty prompt")
    full = len(blocks)
    if full != n // cache.block_tokens or not 0 <= hit_blocks <= full:
        raise ValueError(
            f"{n} tokens fill {n // cache.block_tokens} blocks of {cache.block_tokens}; got {full} blocks, {hit_blocks} hits"
        )
    device = model.device
    ids = torch.as_tensor(blocks, dtype=torch.long, device=device)
    loaded = hit_blocks * cache.block_tokens
    start = min(loaded, n - 1)
    past = cache.read(ids[:hit_blocks], start) if start else (None, None)
    token, k, v = model.forward(torch.tensor(tokens[start:], dtype=torch.long, device=device), start, *past)
    if full > hit_blocks:
        end = full * cache.block_tokens - start
        cache.write(ids[hit_blocks:], k[:, loaded - start : end], v[:, loaded - start : end])
    return token
