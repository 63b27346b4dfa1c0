"""What a run leaves on disk to be resumed or used: checkpoints and the training state.

``checkpoint`` writes the policy as a Hugging Face directory, atomically; ``train_state``
the model, optimizer, RNG, data position and slot counters (torch.distributed.checkpoint)
and finds what to resume. May import ``model``, ``metrics`` and the base modules.
"""
