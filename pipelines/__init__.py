"""``llamarl.pipelines``: the trainer's rollout stream as a ``torchdata.nodes`` graph

(``rollouts``: queue -> contract check -> score -> advantages -> staleness filter -> settled
batches). May import ``llamarl.app``'s ``control``, ``rl``, ``rewards`` and base modules;
imported only by ``llamarl.app.roles``.
"""
