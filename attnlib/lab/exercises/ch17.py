"""Chapter 17, the tiles on a GPU: the key blocks a causal Triton program must visit."""

from .core import Bug, Case, Exercise, Section

CHAPTER = "17_triton"
SKIPPED = Section(CHAPTER, "17.3", "The blocks a program never reads")

BUGS = {
    "triton_diagonal_skipped": Bug(
        "Only the key blocks that every query of the block sees whole were visited. The "
        "diagonal block, which the rule shows in part, must be visited too, under the mask; "
        "skipping it drops each query's newest keys, its own included.",
        SKIPPED,
    ),
    "triton_offset_ignored": Bug(
        "The query indices were taken for positions, as if the queries started at key 0. With "
        "S - T keys before them, query i sits at position S - T + i, and its program must "
        "read that many more keys.",
        SKIPPED,
    ),
    "triton_end_off_by_one": Bug(
        "The loop stopped before the key at the block's largest position: a query sees the "
        "key at its own position, so the end is that position plus one.",
        SKIPPED,
    ),
}


def _tiles(queries, keys, block, *, offset=True, whole_only=False, end_shift=1):
    """Tiles visited: per query block, the key blocks before its end (eq. 17.1), summed."""
    first = keys - queries if offset else 0  # position of query 0
    total = 0
    for start in range(0, queries, block):
        if whole_only:  # keys at or before the block's smallest position: all seen by every row
            end = first + start + 1
            total += end // block
        else:
            end = first + min(start + block, queries) - 1 + end_shift  # one past the largest
            total += -(-end // block)  # key blocks that hold a key before `end`
    return float(total)


def _reference(queries, keys, block):
    return _tiles(queries, keys, block)


def _cases():
    return [
        Case((32, 32, 16), "T=S=32, block=16"),
        Case((20, 50, 16), "T=20 at the end of S=50, block=16"),
        Case((1, 33, 16), "one decode query at position 32, S=33, block=16"),
        Case((24, 40, 8), "T=24 at the end of S=40, block=8"),
        Case((17, 17, 16), "T=S=17, block=16"),
    ]


EXERCISES = {
    "triton_tiles": Exercise(
        "fn(queries, keys, block) -> tiles",
        "Tiles (query block x key block) that the causal forward's programs visit, queries at "
        "positions S-T..S-1 and keys at 0..S-1, blocks of `block` on both axes.",
        _cases,
        _reference,
        ("tiles (a number)",),
        {
            "triton_diagonal_skipped": lambda t, s, b: _tiles(t, s, b, whole_only=True),
            "triton_offset_ignored": lambda t, s, b: _tiles(t, s, b, offset=False),
            "triton_end_off_by_one": lambda t, s, b: _tiles(t, s, b, end_shift=0),
        },
    ),
}
