"""The codec: how K/V rows become bytes and back, and everything about it that does not depend
on the data (schemes, per-layer plans, codebooks, rotations, calibration, the K/V sides)."""
