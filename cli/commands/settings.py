"""`config show|set|unset`: the effective configuration with where each value comes from."""

from __future__ import annotations

import argparse
import os

from tqstore import config as tqconfig

from ..context import Context
from ..output import size


def register(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("config", parents=[common], help="show or change settings",
                       description="Show the effective settings, or change one in HOME/config.toml. Environment "
                                   "variables (TQSTORE_*) override the file.")
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    show = verbs.add_parser("show", parents=[common], help="every setting, its value and where it comes from")
    show.set_defaults(func=show_config)
    set_ = verbs.add_parser("set", parents=[common], help="set KEY to VALUE in the config file (validated)")
    set_.add_argument("key", metavar="KEY", help=f"one of: {', '.join(tqconfig.config_keys())}")
    set_.add_argument("value", metavar="VALUE")
    set_.set_defaults(func=set_config)
    unset = verbs.add_parser("unset", parents=[common], help="remove KEY from the config file")
    unset.add_argument("key", metavar="KEY")
    unset.set_defaults(func=set_config, value=None)


def settings(ctx: Context) -> list[dict]:
    """[{key, value, source, env, size}] for every setting; source is "env", "file" or "default"."""
    config, sources = ctx.config, tqconfig.sources(ctx.config)
    return [{"key": s.dotted, "value": getattr(config, s.field), "source": sources[s.dotted], "env": s.env,
             "size": s.is_size} for s in map(tqconfig.setting, tqconfig.config_keys())]


def show_config(ctx: Context, args: argparse.Namespace) -> int:
    rows = settings(ctx)
    home_source = "flag" if args.home else ("env" if os.environ.get("TQSTORE_HOME") else "default")
    doc = {"home": {"value": str(ctx.home), "source": home_source},
           "file": str(ctx.config.config_path),
           "settings": [{k: v for k, v in row.items() if k != "size"} for row in rows]}

    def human() -> None:
        table = [("home", str(ctx.home), home_source)]
        for row in rows:
            value = row["value"]
            shown = "-" if value is None else (size(value) if row["size"] else str(value))
            source = row["env"] if row["source"] == "env" else row["source"]
            table.append((row["key"], shown, source))
        ctx.out.table(("KEY", "VALUE", "SOURCE"), table)
        ctx.out.note(f"config file: {ctx.config.config_path}")

    ctx.out.emit(doc, human)
    return 0


def set_config(ctx: Context, args: argparse.Namespace) -> int:
    path = tqconfig.save_config_value(args.home, args.key, args.value)
    setting = tqconfig.setting(args.key)
    key = setting.dotted
    overridden = bool(os.environ.get(setting.env))

    def human() -> None:
        ctx.out.note(f"{'removed' if args.value is None else 'set'} {key} in {path}")
        if overridden:
            ctx.out.note(f"note: ${setting.env} is set and overrides the file")

    ctx.out.emit({"key": key, "value": args.value, "file": str(path), "overridden_by_env": overridden}, human)
    return 0
