"""The control plane: one ``TCPStore`` hosted by trainer replica 0, and what rides on it.

Owns the store and its bounded queues (``transport``), the authenticated wire format
(``frames``), signed records for every value that steers a run (``signed``), who is alive
(``membership``, ``health``, ``replica_lock``), which groups were already taken
(``seen_groups``, ``incarnations``), the staleness slots (``slots``, ``overdue``), a
generator's outbox of rollout groups (``outbox``), and the runtime every role runs inside
(``runtime``: join, heartbeat, report metrics, fail loudly, exit cleanly). May import
``rl`` (the rollout contract), ``config``, ``metrics`` and the base modules; not
``weights``, ``pipelines`` or ``roles``.
"""
