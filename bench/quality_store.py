"""Per-(text, scheme) results of the issue-31 protocol kept in one JSON file, so a long run over
three texts can stop and resume, and schemes added later join the same table and plot.

Each record holds the per-position KL, top-1, stored bits, seconds, and the git revision and
date it was measured at; the table's provenance line names every revision its rows came from.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import numpy as np


def load(path: Path) -> dict:
    """{text label: {run key: record}} from `path` (empty when it does not exist)."""
    return json.loads(path.read_text()) if path.exists() else {}


def key(scheme: str, variant: str) -> str:
    return f"{scheme} | {variant}"


def put(path: Path, store: dict, text: str, result, revision: str) -> None:
    """Record one ProtocolResult for `text` and rewrite the file (atomically, by rename), merged
    with what another run wrote there meanwhile."""
    for label, records in load(path).items():
        for name, record in records.items():
            store.setdefault(label, {}).setdefault(name, record)
    store.setdefault(text, {})[key(result.scheme, result.variant)] = {
        "scheme": result.scheme, "variant": result.variant, "kl": [round(float(x), 7) for x in result.kl],
        "top1": result.top1, "bits": result.bits, "seconds": round(result.seconds, 1),
        "git": revision, "date": str(datetime.date.today())}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(store, indent=0))
    tmp.replace(path)


def as_result(record: dict):
    """A stored record as a ProtocolResult (the table and the plot read those)."""
    from turboquant.quality import ProtocolResult

    return ProtocolResult(record["scheme"], record["variant"], np.array(record["kl"], dtype=np.float64),
                          record["top1"], record["bits"], record["seconds"])
