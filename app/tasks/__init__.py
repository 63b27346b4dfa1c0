"""The built-in task, the shipped datasets and answer checking. Pure: no torch, no process groups.

``arithmetic``: GSM8K-style word problems; ``answers``: final answers extracted from
solutions and completions, and when two are equal; ``samples``: the datasets that ship
with llamarl (``--dataset gsm8k-sample``). May import the base modules only.
"""
