"""Layer 6, `tqstore serve`: the OpenAI- and Anthropic-compatible HTTP server over one
model-owner worker that batches decoding.
Imports the engine and everything below it; nothing below imports this package.
"""
