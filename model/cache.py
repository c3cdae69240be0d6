"""The KV cache: the keys and values one attention layer has computed so far, kept for the next step."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of one attention layer, preallocated for max_len positions and written by position.

    Decoding writes one position per step into the same buffers, so nothing is copied or regrown as the
    sequence gets longer. `update` is the only write.
    """

    def __init__(self, batch_size: int, n_head: int, max_len: int, head_size: int, device, dtype):
        self.k = torch.zeros((batch_size, n_head, max_len, head_size), device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.positions = torch.arange(max_len, device=device).view(1, max_len)  # (T = 1, S): to mask unfilled ones
        # positions filled so far; a write at a tensor position leaves it to whoever set that position,
        # because reading the tensor here would wait for the device at every step
        self.length = 0

    def update(self, input_pos: int | torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write k, v (B, nh, T, hs) at positions input_pos.. and return (keys, values, mask): what the
        attention of those T queries reads.

        An int input_pos gives the filled positions, (B, nh, S, hs) with S = input_pos + T, and no mask
        (each query sees the positions up to its own). A 0-d tensor input_pos (T = 1) gives the whole
        buffers, (B, nh, max_len, hs), and a bool mask (1, max_len), True where filled: every step then
        has the same shapes and memory addresses, which is what a recorded CUDA graph needs to replay.
        """
        if isinstance(input_pos, torch.Tensor):
            self.k.index_copy_(2, input_pos.view(1), k)
            self.v.index_copy_(2, input_pos.view(1), v)
            return self.k, self.v, self.positions <= input_pos
        end = input_pos + k.size(2)
        self.k.narrow(2, input_pos, k.size(2)).copy_(k)
        self.v.narrow(2, input_pos, v.size(2)).copy_(v)
        self.length = end
        return self.k.narrow(2, 0, end), self.v.narrow(2, 0, end), None
