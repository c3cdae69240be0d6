"""The KV cache: the keys and values one attention layer has computed so far, kept for the next step."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of one attention layer, preallocated for max_len positions and written by position.

    Decoding writes one position per step into the same buffers, so nothing is copied or regrown as the
    sequence gets longer. A position may be given as a 0-d tensor instead of an int: then the write and
    the attention read the whole buffer, masking the positions not yet filled, so every step has the
    same shapes and the same memory addresses, which is what a captured CUDA graph needs to replay it.
    """

    def __init__(self, batch_size: int, n_head: int, max_len: int, head_size: int, device, dtype):
        # keys and values side by side, (B, 2, nh, max_len, hs), so that one copy writes both
        self.kv = torch.zeros((batch_size, 2, n_head, max_len, head_size), device=device, dtype=dtype)
        self.k, self.v = self.kv[:, 0], self.kv[:, 1]  # views, (B, nh, max_len, hs)
        self.positions = torch.arange(max_len, device=device).view(1, max_len)  # (T = 1, S)
        self.length = 0  # positions filled so far (after a write at a tensor position: mark_filled)

    @property
    def max_len(self) -> int:
        return self.kv.size(3)

    def update(self, start_pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, nh, T, hs) at positions start_pos.. and return every filled position, (B, nh, S, hs)."""
        end = start_pos + k.size(2)
        self.k[:, :, start_pos:end] = k
        self.v[:, :, start_pos:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def mark_filled(self, length: int) -> None:
        """Record that positions 0..length-1 hold keys and values: after a write at a tensor position,
        whose value the cache does not read back (that would wait for the device every step)."""
        if not 0 <= length <= self.max_len:
            raise ValueError(f"a cache of {self.max_len} positions cannot hold {length}")
        self.length = length

    def append(self, pos: int | torch.Tensor, kv: torch.Tensor):
        """Write one position's keys and values, kv (B, 2, nh, hs), at pos, the next free position.

        Returns (keys, values, mask) for one query at pos: with an int pos, the filled positions
        (B, nh, pos + 1, hs) and no mask; with a 0-d tensor pos, the whole buffers and a bool mask
        (1, max_len) that is True for the filled positions."""
        if isinstance(pos, torch.Tensor):
            self.kv.index_copy_(3, pos.view(1), kv.unsqueeze(3))
            return self.k, self.v, self.positions <= pos
        self.kv[:, :, :, pos] = kv
        self.length = pos + 1
        return self.k[:, :, : pos + 1], self.v[:, :, : pos + 1], None
