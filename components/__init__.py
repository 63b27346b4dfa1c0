"""``llamarl.components``: the TorchX component (``llamarl``: the multi-role AppDef) and

llamarl's scheduler variants (``llamarl_local``, ``llamarl_slurm``, ``llamarl_kubernetes``).
Deploy only: names the roles' entry points as strings and imports nothing of
``llamarl.app`` (a component file must load in torchx's parser without torch).
"""
