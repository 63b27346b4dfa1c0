"""benchmarks/table.py: a printed table's header and rows line up from one spec per column."""

import pytest

from benchmarks.table import Table


def test_the_header_takes_each_columns_alignment_and_width_from_its_spec():
    t = Table(("method", "<8"), ("seconds", ">9.3f"), ("ratio", ">7.2f"), sep=" ")
    lines = [t.header(), t.row("raw", 0.12345, 1.0), t.row("sharded", 0.2, 1.625)]
    assert lines == ["method     seconds   ratio", "raw          0.123    1.00", "sharded      0.200    1.62"]
    assert len({len(line) for line in lines}) == 1


def test_a_row_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match="2 cells, got 3"):
        Table(("a", "<3"), ("b", ">3")).row(1, 2, 3)
