"""prefetch.py's schedule: what each prefetch point of a captured decode step asks the L2 cache for, given the step's
weight reads in launch order. No GPU needed."""

from leat_backend_cuda.prefetch import RANGE_BYTES, Read, Schedule

MB = 2**20


def covered(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The ranges merged where they touch: (start, end) spans."""
    spans: list[tuple[int, int]] = []
    for at, size in sorted(ranges):
        assert size % 16 == 0 and at % 16 == 0 and 0 < size <= RANGE_BYTES
        if spans and spans[-1][1] == at:
            spans[-1] = (spans[-1][0], at + size)
        else:
            spans.append((at, at + size))
    return spans


def test_a_point_asks_for_the_next_reads_up_to_the_budget_and_never_twice():
    o, gate, up, down = 1 << 40, 2 << 40, 3 << 40, 4 << 40
    schedule = Schedule(budget=10 * MB)
    schedule.point()  # attention: o and the gated unit follow
    schedule.read(Read([[(o, 4 * MB)]]))
    schedule.read(Read([[(gate, 8 * MB), (up, 8 * MB)]]))  # read side by side
    schedule.point()  # a point after the gated unit has begun: only what the first did not ask for
    schedule.read(Read([[(down, 8 * MB)]]))
    first, second = schedule.ranges()
    # 4 MB of o, then 6 MB of the gated unit's 16: the first 3 MB of gate and of up
    assert covered(first) == [(o, o + 4 * MB), (gate, gate + 3 * MB), (up, up + 3 * MB)]
    # the second point stands after o and the gated unit (20 MB into the stream): the next 10 MB are down's 8
    assert covered(second) == [(down, down + 8 * MB)]


def test_segments_are_read_one_after_another_and_planes_side_by_side():
    q, k, v, plane = 1 << 40, 2 << 40, 3 << 40, 5 << 40
    schedule = Schedule(budget=6 * MB)
    schedule.point()
    schedule.read(Read([[(q, 4 * MB)], [(k, 1 * MB)], [(v, MB // 2), (plane, MB // 2)]]))
    (asked,) = schedule.ranges()
    assert covered(asked) == [(q, q + 4 * MB), (k, k + MB), (v, v + MB // 2), (plane, plane + MB // 2)]


def test_points_with_nothing_left_ask_for_nothing():
    schedule = Schedule(budget=64 * MB)
    schedule.point()
    schedule.read(Read([[(1 << 40, 1 * MB)]]))
    schedule.point()
    schedule.point()
    first, second, third = schedule.ranges()
    assert covered(first) == [(1 << 40, (1 << 40) + MB)]
    assert second == [] and third == []
