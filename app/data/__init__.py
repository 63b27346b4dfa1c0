"""A run's prompts: dataset files and the built-in task, the prompt format and order, and
the check that every role reads the same ones.

``datafile`` reads JSONL, Parquet and ``datasets`` directories, naming every bad row;
``sources`` resolves the policy, prepares prompts and publishes their fingerprint. May
import ``control`` (to publish and check), ``rl`` (the warm start), ``model``, ``tasks``,
``config`` and the base modules.
"""
