"""What the tables of the commands that run models share (graphscan_ort/shared/tables.py):
the red-flag rankings against their definition, a stable sort on the value."""

import pytest

from graphscan_ort.shared import tables

# Values with ties, a zero (a 0 dB row, the worst of an SQNR ranking), a negative and a
# missing one: every row with a value is ranked, ties keep their order.
ROWS = [{"id": k, "v": v} for k, v in enumerate([3.0, 0.0, None, -1.0, 0.0, 3.0, 0])]


def brute_force(rows, key, largest):
    """By definition: every row whose value is not None, by value, equal values in row order."""
    valued = [r for r in rows if r.get(key) is not None]
    order = []
    while valued:
        best = (max if largest else min)(r[key] for r in valued)
        first = next(r for r in valued if r[key] == best)
        order.append(first["id"])
        valued.remove(first)
    return order


@pytest.mark.parametrize("largest", [True, False], ids=["largest-first", "smallest-first"])
def test_a_ranking_keeps_every_row_with_a_value_zero_included_and_ties_in_order(largest):
    ranking = tables.largest_first if largest else tables.smallest_first
    got = [r["id"] for r in ranking(ROWS + [{"id": 7}], "v")]
    assert got == brute_force(ROWS, "v", largest)
    assert sorted(got) == [0, 1, 3, 4, 5, 6]
