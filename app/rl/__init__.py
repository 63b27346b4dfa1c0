"""RL: the rollout contract, the losses, the trainer's forward pass and one train step.

``losses`` and ``mismatch`` are pure functions of tensors returning ``(loss, metrics)``;
``contract`` is the data that flows between executors and its one wire format; ``packing``
the packed forward; ``step`` one policy-gradient step, scoring and evaluation shared by the
trainer and the single-process loop; ``steps`` a step's bookkeeping; ``sharding`` FSDP2;
``warmstart`` the supervised warm start. May import ``config``, ``rewards``, ``sampling``,
``model``, ``tasks``, ``metrics`` and the base modules; never ``control`` or ``weights``
(no store, no transport).
"""
