"""Generation over a transformers model with vLLM's sampling semantics (the hf engine, Stage-B).
"""
