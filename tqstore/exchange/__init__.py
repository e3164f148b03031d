"""Layer 5, entries through single files: tqstore's portable bundle and mlx-lm's prompt-cache
files. Imports the store and the engine.
"""
