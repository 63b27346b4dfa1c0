"""Measured comparisons that print a table and write JSON (benchmarks/README.md).

A package, so that benchmarks import each other, the shared launcher (``apps``) and the
table printer (``table``) one way:
``from benchmarks.<module> import ...``. Each runs from the repository root as
``python benchmarks/<name>.py`` (a script that imports a sibling puts the repository root on
``sys.path`` first) or ``python -m benchmarks.<name>``.
"""
