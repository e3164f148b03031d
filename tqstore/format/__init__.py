"""Layer 2, the stored bytes: token blocks and their keys, object headers, the object frame and
entry manifests. Pure functions from values to bytes and back; no I/O, no tiers, no model.

Imports only the foundation (`tqstore.errors`, `canonical`, `names`) and `tqstore.models`.
"""
