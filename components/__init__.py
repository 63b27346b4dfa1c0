"""``llamarl.components``: the TorchX component (``llamarl``: the multi-role AppDef) and

llamarl's scheduler variants (``local_llamarl``, ``slurm_llamarl``, ``kubernetes_llamarl``).
Deploy only: names the roles' entry points as strings and imports nothing of
``llamarl.app`` (a component file must load in torchx's parser without torch).
"""
