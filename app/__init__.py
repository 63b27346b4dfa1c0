"""llamarl's executors and the planes they share: ``llamarl.app``.

One subpackage per plane; each opens with what it owns and what it may import. The layer
contract (which package may import which) is written in ``docs/architecture.md`` and checked
by ``lint-imports`` (pyproject.toml's ``[tool.importlinter]``) in CI. Top to bottom:

- ``roles``: the entry points (parse, build, run, close): trainer, generator, reward, local,
  launch, stop.
- ``weights``, ``state``, ``data``: the weight plane; checkpoints and training state; a
  run's prompts and the check that every role reads the same ones.
- ``control``: the control store, frames, signed records, membership, health, the runtime
  every role runs in.
- ``rl``: the RL math and the train step (pure where it can be), the rollout contract.
- ``config``: the typed config of each executor.
- ``rewards``, ``sampling``: reward components; batched sampling with behaviour log-probs.
- ``model``: the policy and its tokenizer.
- ``tasks``, ``metrics``: the built-in task and answer checking; metric events and the
  metrics database.
- ``devices``, ``cli``, ``names``, ``errors``: devices and precision; flags from config
  dataclasses; every key and metric name; the errors a user reads.
"""
