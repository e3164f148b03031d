"""Caches holding compressed K/V: the two-phase `TurboQuantKVCache`, layers kept at rest, the
token buffers they grow in, and the bit allocation measured on them."""
