"""Layer 4, the model side: prefill and save a context, restore it, answer questions, and compose
stored document chunks. Imports the store and everything below it; never the server or the CLI.
"""
