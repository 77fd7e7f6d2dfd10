"""Where a block's bytes are: in the KV-cache tensors and in a pool slot.

An offloaded block of KV group g spans `block_size_factor` (f) consecutive GPU blocks.
Its slot holds, for each of the group's refs in order, f sub-blocks of the ref's
page size back to back (ref-major, then sub-block).

A transfer is planned as byte runs (tensor, offset in the tensor, offset in the rank's
pool region, size), adjacent pieces merged into one run. Runs are ordered by pool row
and cut into segments of whole rows, so that a store can seal a segment's rows while
later segments are still being copied.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from distkv.abstract import CanonicalKVCaches
from distkv.storage.pool import PoolLayout

# A slot header marks the sub-blocks written in one 64-bit word (pool.Sealed.filled).
MAX_BLOCK_SIZE_FACTOR = 63


@dataclass(frozen=True)
class RefPlacement:
    """Where one ref of a KV group lies within a slot."""

    tensor_idx: int
    page_bytes: int  # un-padded bytes of a tensor row that are copied
    slot_offset: int  # where the ref's f sub-blocks start in the slot


@dataclass(frozen=True)
class SlotLayout:
    """The placement of every KV group's data in a pool slot."""

    block_size_factor: int
    groups: tuple[tuple[RefPlacement, ...], ...]

    @classmethod
    def from_kv_caches(cls, kv_caches: CanonicalKVCaches, block_size_factor: int) -> "SlotLayout":
        if not 1 <= block_size_factor <= MAX_BLOCK_SIZE_FACTOR:
            raise ValueError(
                f"block_size_factor={block_size_factor} must be in 1..{MAX_BLOCK_SIZE_FACTOR}: "
                "a slot header has a bit per sub-block"
            )
        if not kv_caches.group_data_refs:
            raise ValueError("the KV caches have no KV group")
        tensors = [t.tensor for t in kv_caches.tensors]
        for idx, tensor in enumerate(tensors):
            if tensor.ndim != 2 or tensor.element_size() != 1 or (tensor.shape[1] > 1 and tensor.stride(1) != 1):
                raise ValueError(
                    f"KV tensor {idx} must be (num_blocks, page_bytes) of 1-byte elements with "
                    f"contiguous rows, got shape {tuple(tensor.shape)}, dtype {tensor.dtype}, "
                    f"strides {tensor.stride()}"
                )
            if tensor.device != tensors[0].device:
                raise ValueError(f"KV tensor {idx} is on {tensor.device}, tensor 0 on {tensors[0].device}")
        groups = []
        for g, refs in enumerate(kv_caches.group_data_refs):
            if not refs:
                raise ValueError(f"KV group {g} has no data refs")
            placements = []
            offset = 0
            for ref in refs:
                if not 0 <= ref.tensor_idx < len(tensors):
                    raise ValueError(
                        f"KV group {g} refers to tensor {ref.tensor_idx} of {len(tensors)}"
                    )
                row_bytes = tensors[ref.tensor_idx].shape[1]
                if not 0 < ref.page_size_bytes <= row_bytes:
                    raise ValueError(
                        f"KV group {g}: page of {ref.page_size_bytes} bytes does not fit "
                        f"tensor {ref.tensor_idx}'s rows of {row_bytes} bytes"
                    )
                placements.append(RefPlacement(ref.tensor_idx, ref.page_size_bytes, offset))
                offset += block_size_factor * ref.page_size_bytes
            groups.append(tuple(placements))
        return cls(block_size_factor, tuple(groups))

    @property
    def group_bytes(self) -> tuple[int, ...]:
        """Bytes of a slot that one offloaded block of each group fills."""
        return tuple(self.block_size_factor * sum(r.page_bytes for r in refs) for refs in self.groups)

    @property
    def slot_bytes_needed(self) -> int:
        return max(self.group_bytes)

    def check_fits(self, slot_bytes: int) -> None:
        if slot_bytes < self.slot_bytes_needed:
            raise ValueError(
                f"pool slots of {slot_bytes} bytes are smaller than the {self.slot_bytes_needed} "
                f"bytes an offloaded block needs (block_size_factor={self.block_size_factor})"
            )


@dataclass(frozen=True)
class CopyPlan:
    """The byte runs of one transfer, cut into segments of whole pool rows.

    Segment s holds runs run_bounds[s]:run_bounds[s+1], which fill the rows at positions
    row_bounds[s]:row_bounds[s+1] of the transfer's row list; group g has the rows at
    positions group_row_bounds[g]:group_row_bounds[g+1]. filled[i]: the sub-blocks of the
    i-th row the transfer copies, bit k for sub-block k (the first row of a transfer whose
    first block is unaligned, and its last, may be copied in part).
    """

    tensor_idx: np.ndarray
    tensor_offset: np.ndarray
    pool_offset: np.ndarray  # from the start of the rank's region
    nbytes: np.ndarray
    run_bounds: np.ndarray
    row_bounds: np.ndarray
    group_row_bounds: np.ndarray
    filled: np.ndarray

    @property
    def num_segments(self) -> int:
        return len(self.run_bounds) - 1

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())


@dataclass(frozen=True)
class _GroupRefs:
    tensor_idx: np.ndarray  # (refs,)
    row_stride: np.ndarray
    page_bytes: np.ndarray
    slot_offset: np.ndarray
    num_blocks: int  # GPU blocks every tensor of the group has


class CopyPlanner:
    """Turns (GPU blocks, pool rows) into a CopyPlan, with numpy.

    segment_bytes: a segment holds that many bytes of rows (at least one row).
    piece_bytes: no run may cross a multiple of it in the pool region (pinned pieces).
    """

    def __init__(
        self,
        layout: SlotLayout,
        tensors: Sequence[torch.Tensor],
        pool_layout: PoolLayout,
        segment_bytes: int,
        piece_bytes: int | None = None,
    ):
        self.layout = layout
        self._slot_bytes = pool_layout.slot_bytes
        self._num_rows = pool_layout.num_rows
        self._rows_per_segment = max(segment_bytes // pool_layout.slot_bytes, 1)
        self._piece_bytes = piece_bytes
        self._groups = [
            _GroupRefs(
                tensor_idx=np.array([r.tensor_idx for r in refs], dtype=np.int64),
                row_stride=np.array([tensors[r.tensor_idx].stride(0) for r in refs], dtype=np.int64),
                page_bytes=np.array([r.page_bytes for r in refs], dtype=np.int64),
                slot_offset=np.array([r.slot_offset for r in refs], dtype=np.int64),
                num_blocks=min(tensors[r.tensor_idx].shape[0] for r in refs),
            )
            for refs in layout.groups
        ]

    def plan(
        self,
        block_ids: np.ndarray,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
        rows: np.ndarray,
    ) -> CopyPlan:
        """vLLM's mapping: sub-block k of group g (first logical index b) goes to the
        group's pool row (k + b % f) // f, sub-block (k + b % f) % f."""
        f = self.layout.block_size_factor
        num_groups = len(self._groups)
        sizes = np.asarray(group_sizes, dtype=np.int64).reshape(-1)
        firsts = np.asarray(block_indices, dtype=np.int64).reshape(-1)
        if len(sizes) != num_groups or len(firsts) != num_groups:
            raise ValueError(
                f"transfer has {len(sizes)} group sizes and {len(firsts)} block indices, "
                f"the KV caches have {num_groups} KV groups"
            )
        if (sizes < 0).any() or (firsts < 0).any():
            raise ValueError(f"negative group sizes {sizes.tolist()} or block indices {firsts.tolist()}")
        if sizes.sum() != len(block_ids):
            raise ValueError(f"group sizes sum to {sizes.sum()}, there are {len(block_ids)} GPU blocks")
        skips = firsts % f
        group_rows = np.where(sizes > 0, -(-(sizes + skips) // f), 0)
        if group_rows.sum() != len(rows):
            raise ValueError(
                f"transfer names {len(rows)} pool rows, its GPU blocks fill {group_rows.sum()} "
                f"(rows per group {group_rows.tolist()}, block_size_factor={f})"
            )
        if len(rows) and (rows.min() < 0 or rows.max() >= self._num_rows):
            bad = rows[(rows < 0) | (rows >= self._num_rows)]
            raise ValueError(f"pool rows {bad[:8].tolist()} out of range [0, {self._num_rows})")
        block_bounds = np.concatenate(([0], np.cumsum(sizes)))
        row_bounds = np.concatenate(([0], np.cumsum(group_rows)))
        for g, refs in enumerate(self._groups):
            ids = block_ids[block_bounds[g] : block_bounds[g + 1]]
            if len(ids) and (ids.min() < 0 or ids.max() >= refs.num_blocks):
                bad = ids[(ids < 0) | (ids >= refs.num_blocks)]
                raise ValueError(
                    f"KV group {g}: GPU block ids {bad[:8].tolist()} out of range [0, {refs.num_blocks})"
                )

        filled = np.zeros(len(rows), dtype=np.uint64)
        one = np.uint64(1)
        for g in np.flatnonzero(sizes):
            starts = np.arange(group_rows[g], dtype=np.int64) * f
            first = np.clip(skips[g] - starts, 0, f).astype(np.uint64)
            end = np.clip(skips[g] + sizes[g] - starts, 0, f).astype(np.uint64)
            filled[row_bounds[g] : row_bounds[g + 1]] = (one << end) - (one << first)
        pieces = [
            self._group_pieces(
                refs,
                block_ids[block_bounds[g] : block_bounds[g + 1]],
                int(skips[g]),
                rows[row_bounds[g] : row_bounds[g + 1]],
                int(row_bounds[g]),
            )
            for g, refs in enumerate(self._groups)
            if sizes[g] > 0
        ]
        return self._coalesce(pieces, len(rows), row_bounds, filled)

    def _group_pieces(
        self, refs: _GroupRefs, ids: np.ndarray, skip: int, rows: np.ndarray, first_row_pos: int
    ) -> tuple[np.ndarray, ...]:
        """One piece per (row, ref, sub-block) the group fills, in that order."""
        f = self.layout.block_size_factor
        num_rows, num_refs = len(rows), len(refs.tensor_idx)
        shape = (num_rows, num_refs, f)
        # positions of the group's sub-blocks in its rows, laid out (row, 1, sub-block)
        padded_ids = np.zeros(num_rows * f, dtype=np.int64)
        padded_ids[skip : skip + len(ids)] = ids
        padded_ids = padded_ids.reshape(num_rows, 1, f)
        position = np.arange(num_rows * f).reshape(num_rows, 1, f)
        filled = np.broadcast_to((position >= skip) & (position < skip + len(ids)), shape)
        sub = np.arange(f, dtype=np.int64).reshape(1, 1, f)
        page = refs.page_bytes.reshape(1, num_refs, 1)

        tensor_idx = np.broadcast_to(refs.tensor_idx.reshape(1, num_refs, 1), shape)
        tensor_offset = padded_ids * refs.row_stride.reshape(1, num_refs, 1)
        pool_offset = (
            rows.reshape(num_rows, 1, 1) * self._slot_bytes
            + refs.slot_offset.reshape(1, num_refs, 1)
            + sub * page
        )
        nbytes = np.broadcast_to(page, shape)
        row_pos = np.broadcast_to((first_row_pos + np.arange(num_rows)).reshape(num_rows, 1, 1), shape)
        return tuple(
            np.broadcast_to(a, shape)[filled] for a in (tensor_idx, tensor_offset, pool_offset, nbytes, row_pos)
        )

    def _coalesce(
        self, pieces: list[tuple[np.ndarray, ...]], num_rows: int, group_row_bounds: np.ndarray, filled: np.ndarray
    ) -> CopyPlan:
        if not pieces:
            empty = np.zeros(0, dtype=np.int64)
            return CopyPlan(
                empty, empty, empty, empty, np.zeros(1, np.int64), np.zeros(1, np.int64), group_row_bounds, filled
            )
        tensor_idx, tensor_offset, pool_offset, nbytes, row_pos = (np.concatenate(a) for a in zip(*pieces))
        segment = row_pos // self._rows_per_segment
        ends_tensor, ends_pool = tensor_offset + nbytes, pool_offset + nbytes
        joins = (
            (tensor_idx[1:] == tensor_idx[:-1])
            & (tensor_offset[1:] == ends_tensor[:-1])
            & (pool_offset[1:] == ends_pool[:-1])
            & (segment[1:] == segment[:-1])
        )
        if self._piece_bytes is not None:
            joins &= pool_offset[1:] % self._piece_bytes != 0
        starts = np.flatnonzero(np.concatenate(([True], ~joins)))
        segment = segment[starts]
        run_bounds = np.concatenate((np.flatnonzero(np.concatenate(([True], segment[1:] != segment[:-1]))), [len(starts)]))
        row_bounds = np.concatenate((np.arange(0, num_rows, self._rows_per_segment), [num_rows]))
        return CopyPlan(
            tensor_idx=tensor_idx[starts],
            tensor_offset=tensor_offset[starts],
            pool_offset=pool_offset[starts],
            nbytes=np.add.reduceat(nbytes, starts),
            run_bounds=run_bounds,
            row_bounds=row_bounds,
            group_row_bounds=group_row_bounds,
            filled=filled,
        )
