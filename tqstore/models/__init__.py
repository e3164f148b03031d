"""Layer 1, models: a model folder's files and digests, the model and codec identity, loading
models, prompt tokens, the BLAS choice, and the offline installer of real checkpoints (`pack`).
Imports only the foundation (`tqstore.errors`, `canonical`, `durable`, `config`).
"""
