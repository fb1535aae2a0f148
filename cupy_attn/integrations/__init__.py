"""Integrations with other libraries, each imported on demand (they import the library they integrate with).

transformers: ``register()`` makes ``attn_implementation="cupy_attn"`` available to Hugging Face models.
"""
