"""`selftest`: check this machine (backend, attention kernels, fsync in the home, BLAS, S3)."""

from __future__ import annotations

import argparse

from .. import checks
from ..context import Context

MARKS = {"ok": "ok", "warn": "WARN", "fail": "FAIL", "skip": "skip"}


def register(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("selftest", parents=[common], help="check this machine (exit 1 if a check fails)",
                       description="Check the MLX backend, TurboQuant attention against a float64 reference, "
                                   "durable writes in the home, the BLAS, and the bucket when S3 is configured.")
    p.set_defaults(func=selftest)


def selftest(ctx: Context, args: argparse.Namespace) -> int:
    results = []
    with ctx.out.status("checking this machine"):
        results.append(checks.backend())
        results.append(checks.attention())
        results.append(checks.home_fsync(ctx.home))
        results.append(checks.blas())
        results.append(checks.s3(ctx.config))
    failed = [c.name for c in results if c.status == "fail"]
    doc = {"ok": not failed,
           "checks": [{"name": c.name, "status": c.status, "detail": c.detail, **c.data} for c in results]}

    def human() -> None:
        ctx.out.table(("CHECK", "STATUS", "DETAIL"), [(c.name, MARKS[c.status], c.detail) for c in results])
        if failed:
            ctx.out.note(f"failed: {', '.join(failed)}")

    ctx.out.emit(doc, human)
    return 1 if failed else 0
