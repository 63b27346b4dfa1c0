"""The built-in task and answer checking. Pure: no torch, no process groups.

``arithmetic``: GSM8K-style word problems; ``answers``: final answers extracted from
solutions and completions, and when two are equal. May import the base modules only.
"""
