"""The weight plane: policy weights straight from trainer ranks to generators (DDMA).

Owns the process groups of the plane (``sync``: one group, bucketed broadcasts, timed;
``plane``: a new group per membership epoch), where each parameter's bytes sit (``layout``)
and which part each trainer rank sends (``shards``), and the signed digest a generator
checks before it swaps (``digest``). May import ``control`` and the base modules; not
``rl``, ``data`` or ``roles``.
"""
