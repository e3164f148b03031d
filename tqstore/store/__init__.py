"""Layer 3, the store: the tiers (memory, LMDB, S3), the `TierSet` of one open home, publishing
entries, restoring them, moving them between tiers, and keeping the home within its budget.

Imports the foundation, `tqstore.models` and `tqstore.format`; never the engine or the server.
"""
