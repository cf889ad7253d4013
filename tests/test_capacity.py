"""The compiled round's KV capacity rule (ddtree.engine.capacity): powers of two up to 4,096 rows, then steps of
4,096 rows (1/16 octave from 65,536 on): the rows read past what a generation needs stay bounded, and so does the
number of graph shapes (each capacity compiles once)."""

from ddtree.engine.capacity import MIN_CAPACITY, QUANTUM, capacity_bucket


def test_capacity_values():
    assert [capacity_bucket(n) for n in (1, 256, 257, 600, 4096)] == [256, 256, 512, 1024, 4096]
    # the bench's contexts (+ 512 new tokens + a 65-node tree): 8,192 and 36,864 (powers of two: 8,192 and 65,536)
    assert capacity_bucket(4096 + 512 + 65) == 8192 and capacity_bucket(32768 + 512 + 65) == 36864
    assert [capacity_bucket(n) for n in (4097, 8193, 65536, 65537, 140_000)] == [8192, 12288, 65536, 73728, 147456]


def test_capacity_bounds_the_rows_past_what_is_needed():
    """An independent check of every size up to 300k rows: at least what is needed, a multiple of 256 (the
    grouped mask's rows 16-aligned), fewer rows past it than max(QUANTUM, needed / 8), monotone."""
    last = MIN_CAPACITY
    for needed in range(1, 300_000):
        cap = capacity_bucket(needed)
        assert cap >= needed and cap % 256 == 0 and cap >= last, needed
        assert cap - needed < max(QUANTUM, needed / 8) or cap == MIN_CAPACITY, needed
        last = cap


def test_capacity_shapes_a_long_context_workload_compiles():
    """Graph shapes (one compile each) a process can meet with contexts up to 32k + 512 new tokens + a 65-node tree:
    13 (12 up to 32,768 rows), where powers of two gave 9; a generation keeps one."""
    shapes = {capacity_bucket(n) for n in range(1, 32768 + 512 + 65 + 1)}
    assert len(shapes) == 13 and max(shapes) == 36864
    powers = {max(256, 1 << (n - 1).bit_length()) for n in range(1, 32768 + 512 + 65 + 1)}
    assert len(powers) == 9 and max(powers) == 65536
