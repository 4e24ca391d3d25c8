"""A paged KV cache: fixed-size blocks in one pool, a block table per sequence (as in vLLM).

A sequence's keys live in blocks of `block_size` tokens scattered over one pool; its block
table lists them in order, so token t sits in block table[t // block_size], slot
t % block_size. Memory is taken a block at a time as sequences grow and given back when they
finish. Sequences that share a prompt share its blocks; the first write into a shared block
copies it (copy on write). `paged_attention` reads through the tables with the positions rule.
"""

import torch

from attnlib import causal_attention


def _blocks_needed(length: int, block_size: int) -> int:
    return -(-length // block_size)  # ceil


def gather(pool: torch.Tensor, table, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence: pool [N, H, bs, D] read through `table`.

    Returns [H, length, D]. Raises ValueError when the table is too short or points past the pool.
    """
    blocks, heads, block_size, dim = pool.shape
    needed = _blocks_needed(length, block_size)
    table = torch.as_tensor(table, dtype=torch.long).reshape(-1)
    if table.numel() < needed:
        raise ValueError(
            f"a sequence of {length} tokens needs {needed} blocks of {block_size}, "
            f"its table lists {table.numel()}"
        )
    used = table[:needed]
    bad = used[(used < 0) | (used >= blocks)]
    if bad.numel():
        raise ValueError(
            f"the block table points at block {int(bad[0])}, past the pool of {blocks} blocks "
            f"(valid: 0..{blocks - 1})"
        )
    tokens = pool[used].permute(1, 0, 2, 3).reshape(heads, needed * block_size, dim)
    return tokens[:, :length]  # [H, length, D]


def paged_attention(q, key_pool, value_pool, tables, lengths, query_positions, scale=None):
    """Attention of each sequence's queries to its cached keys, read through its block table.

    q [B, Hq, T, D]; pools [N, Hkv, bs, D]; tables: B lists of block ids; lengths: B token
    counts; query_positions [B, T]. Key t of a sequence has position t, and the positions rule
    (eq. 7.1) applies; a query may not sit beyond its sequence (position >= length).
    Returns [B, Hq, T, Dv].
    """
    query_positions = torch.as_tensor(query_positions).reshape(q.shape[0], q.shape[2])
    outs = []
    for b, (table, length) in enumerate(zip(tables, lengths)):
        beyond = query_positions[b][query_positions[b] >= length]
        if beyond.numel():
            raise ValueError(
                f"query position {int(beyond[0])} is beyond sequence {b}'s length {length} "
                f"(positions 0..{length - 1} are cached)"
            )
        keys = gather(key_pool, table, length)[None]  # [1, Hkv, length, D]
        values = gather(value_pool, table, length)[None]
        outs.append(
            causal_attention(
                q[b : b + 1],
                keys,
                values,
                query_positions=query_positions[b],
                key_positions=torch.arange(length),
                scale=scale,
            )
        )
    return torch.cat(outs)  # [B, Hq, T, Dv]


class PagedKVCache:
    """A pool of `blocks` blocks of `block_size` tokens each, shared by many sequences.

    Keys and values are [Hkv, D] per token. `tables[seq]` lists a sequence's blocks,
    `lengths[seq]` its token count; `refs[i]` counts the sequences that hold block i.
    """

    def __init__(self, blocks, block_size, kv_heads, head_dim, dtype=torch.float32):
        if blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of one token, got {blocks} x {block_size}")
        shape = (blocks, kv_heads, block_size, head_dim)
        self.keys, self.values = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        self.block_size = block_size
        self.refs = [0] * blocks
        self.free = list(range(blocks))[::-1]  # a stack: the lowest id is taken first
        self.tables, self.lengths = {}, {}

    def _take(self) -> int:
        if not self.free:
            raise ValueError(
                f"pool full: all {len(self.refs)} blocks in use; finish a sequence or grow the pool"
            )
        block = self.free.pop()
        self.refs[block] = 1
        return block

    def _drop(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free.append(block)

    def add(self, seq) -> None:
        """Start an empty sequence."""
        if seq in self.tables:
            raise ValueError(f"sequence {seq!r} exists already")
        self.tables[seq], self.lengths[seq] = [], 0

    def fork(self, parent, child) -> None:
        """Start `child` as a copy of `parent` that shares all its blocks (no copy yet)."""
        self.add(child)
        self.tables[child] = list(self.tables[parent])
        self.lengths[child] = self.lengths[parent]
        for block in self.tables[child]:
            self.refs[block] += 1

    def append(self, seq, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append tokens to a sequence: keys and values [Hkv, T, D] (or [Hkv, D] for one)."""
        if keys.dim() == 2:
            keys, values = keys[:, None], values[:, None]
        for t in range(keys.shape[1]):
            position = self.lengths[seq]
            index, slot = divmod(position, self.block_size)
            table = self.tables[seq]
            if index == len(table):  # the last block is full (or there is none): take one
                table.append(self._take())
            elif self.refs[table[index]] > 1:  # shared: copy on write
                old, new = table[index], self._take()
                self.keys[new], self.values[new] = self.keys[old], self.values[old]
                self._drop(old)
                table[index] = new
            self.keys[table[index], :, slot] = keys[:, t]
            self.values[table[index], :, slot] = values[:, t]
            self.lengths[seq] = position + 1

    def finish(self, seq) -> None:
        """Forget a sequence and give back the blocks no other sequence holds."""
        for block in self.tables.pop(seq):
            self._drop(block)
        del self.lengths[seq]

    def attend(self, seqs, q, query_positions, scale=None):
        """`paged_attention` for the sequences `seqs` (q [len(seqs), Hq, T, D])."""
        tables = [self.tables[s] for s in seqs]
        lengths = [self.lengths[s] for s in seqs]
        return paged_attention(q, self.keys, self.values, tables, lengths, query_positions, scale)

    def blocks_in_use(self) -> int:
        """Blocks held by at least one sequence; a shared block counts once."""
        return sum(1 for r in self.refs if r > 0)

    def bytes_per_block(self) -> int:
        """Bytes of keys and values one block holds."""
        return 2 * self.keys[0].numel() * self.keys.element_size()


def memory_table(lengths, block_size, kv_heads, head_dim, bytes_per_number=4, reserve=None) -> dict:
    """Bytes held for sequences of these lengths: paged against contiguous (eq. 21.2).

    Returns tokens stored, blocks, paged bytes, contiguous bytes (B x reserve) and the share
    of each that holds tokens. A contiguous cache reserves `reserve` slots per sequence: by
    default max(lengths), the longest length that occurred, which flatters it (a server
    reserves the longest it allows, since it cannot know where a sequence stops).
    """
    reserve = max(lengths) if reserve is None else reserve
    if reserve < max(lengths):
        raise ValueError(f"reserve ({reserve}) is below the longest length ({max(lengths)})")
    per_token = 2 * kv_heads * head_dim * bytes_per_number  # a key and a value
    tokens = sum(lengths)
    blocks = sum(_blocks_needed(n, block_size) for n in lengths)
    paged = blocks * block_size * per_token
    contiguous = len(lengths) * reserve * per_token
    return {
        "tokens": tokens,
        "blocks": blocks,
        "paged_bytes": paged,
        "contiguous_bytes": contiguous,
        "paged_used": tokens * per_token / paged,
        "contiguous_used": tokens * per_token / contiguous,
    }
