"""The policy: a causal LM and its tokenizer, built, saved and loaded as a Hugging Face
directory (``policy``). May import ``tasks`` and the base modules.
"""
