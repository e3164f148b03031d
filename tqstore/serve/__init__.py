"""Layer 6, `tqstore serve`: the OpenAI-compatible HTTP server over one model-owner worker.
Imports the engine and everything below it; nothing below imports this package.
"""
