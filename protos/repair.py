"""``dadfl.protos.repair`` — repair only what differs: a replica's state in blocks, each with its own hash.

The state (``state.py``: weights, buffers, optimizer state, in its key order) is cut into
blocks of ``BLOCK_ELEMENTS`` elements of each tensor's flat view; each block's hash is the
XXH3-64 of its tensor's key, its index and its bytes. A site whose weights fingerprint
differs from the server's sends its block hashes (8 bytes per block: 1.2 KB for a 10M
model); the server answers with the blocks whose hashes differ from its own (a REPAIR
payload, keys ``<state key>@<block>``), and with the full state only when the lists do not
line up (another count: optimizer state not created yet at one side) or the repair did not
restore the fingerprint. Replicas that differ by a few rounded bits (another machine's
kernels, ``strategies/canonical.py``) or by one altered weight get back in a few blocks.

Block size: 64K elements (256 KB of float32) keeps the hash list under 0.01% of the state
and a repair of one differing element to one block; smaller blocks cut repair bytes and
grow the list in proportion.
"""

from __future__ import annotations

import math

import torch
import xxhash

from dadfl.replica import Replica
from dadfl.sanitize import printable
from dadfl.strategies import Payload

from .state import state_payload

BLOCK_ELEMENTS = 1 << 16
BLOCK_SEPARATOR = "@"


def state_blocks(replica: Replica) -> list[tuple[str, int, torch.Tensor]]:
    """``(state key, block index, flat view of the block)`` for every block of the state, in order."""
    blocks = []
    for key, tensor in state_payload(replica, 0).tensors.items():
        flat = tensor.detach().reshape(-1)
        for index in range(max(1, math.ceil(flat.numel() / BLOCK_ELEMENTS))):
            blocks.append((key, index, flat[index * BLOCK_ELEMENTS : (index + 1) * BLOCK_ELEMENTS]))
    return blocks


def block_hashes(replica: Replica) -> list[int]:
    """The XXH3-64 of every block of ``replica``'s state (module docstring)."""
    hashes = []
    for key, index, block in state_blocks(replica):
        digest = xxhash.xxh3_64()
        digest.update(f"{key}{BLOCK_SEPARATOR}{index}".encode())
        digest.update(block.cpu().contiguous().view(torch.uint8).numpy())
        hashes.append(digest.intdigest())
    return hashes


def repair_payload(replica: Replica, next_step: int, site_hashes: list[int], own_hashes: list[int]) -> Payload | None:
    """The blocks of ``replica``'s state whose hashes differ from ``site_hashes``; None when the
    lists do not line up (another block count), so only the full state can repair the site."""
    if len(site_hashes) != len(own_hashes):
        return None
    tensors = {}
    for (key, index, block), theirs, ours in zip(state_blocks(replica), site_hashes, own_hashes):
        if theirs != ours:
            tensors[f"{key}{BLOCK_SEPARATOR}{index}"] = block.clone()
    return Payload(next_step, 0, 0, tensors)


def apply_repair(replica: Replica, payload: Payload) -> int:
    """Copy the payload's blocks into ``replica``'s state; return how many. A ValueError naming
    the first block that does not fit (unknown key or index, another dtype or length) before
    anything is written."""
    blocks = {f"{key}{BLOCK_SEPARATOR}{index}": block for key, index, block in state_blocks(replica)}
    for key, tensor in payload.tensors.items():
        block = blocks.get(key)
        if block is None:
            raise ValueError(f"repair block {printable(key)} names no block of this replica's state")
        if tensor.dtype != block.dtype or tuple(tensor.shape) != tuple(block.shape):
            raise ValueError(f"repair block {printable(key)} is {tensor.dtype} {tuple(tensor.shape)}, "
                             f"the state's is {block.dtype} {tuple(block.shape)}")
    with torch.no_grad():
        for key, tensor in payload.tensors.items():
            blocks[key].copy_(tensor)
    return len(payload.tensors)
