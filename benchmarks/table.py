"""A benchmark's printed table: each column's title and format stated once.

The header takes a column's alignment and width from its format spec, every row the whole
spec, so that the two cannot drift apart as a column is added or widened.
"""

from __future__ import annotations

import re


class Table:
    """Columns as ``(title, spec)``, ``spec`` a format spec with its alignment and width
    first (``">10.3f"``, ``"<18"``); ``sep`` goes between cells."""

    def __init__(self, *columns: tuple[str, str], sep: str = "") -> None:
        self.columns, self.sep = columns, sep

    def header(self) -> str:
        return self.sep.join(f"{title:{re.match(r'[<>^]?[0-9]*', spec).group()}}" for title, spec in self.columns)

    def row(self, *values: object) -> str:
        if len(values) != len(self.columns):
            raise ValueError(f"a row of this table has {len(self.columns)} cells, got {len(values)}")
        return self.sep.join(f"{value:{spec}}" for value, (_, spec) in zip(values, self.columns))
