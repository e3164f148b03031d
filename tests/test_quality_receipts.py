"""Every scheme of docs/quality.md's table saves with a quality receipt that `ls --json` and
`tqstore info` show (tqstore/engine/receipts.py), the allocated auto schemes included."""

from __future__ import annotations

import json

import pytest

from model_folder import write_model_folder
from tqstore.engine.receipts import PROBE_TOKENS
from tqstore_cli import main as cli_main

DOC = ("The contract says the seller pays for delays. Clause seven covers delivery, payment and penalties. "
       "To abscond is to move in a mysterious way, commonly with the property of another. ") * 4
SCHEMES = ["turbo4", "turbo5v4", "turbo8v3", "turbo3", "auto3.5", "auto6", "affine8"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(write_model_folder(tmp_path_factory.mktemp("model") / "tiny-qwen2"))


@pytest.mark.slow  # seven saves with probes: about 30 s on a quiet 2-core machine, minutes under load
def test_every_scheme_of_the_quality_table_shows_its_receipt(tmp_path, capsys, model):
    def tq(*argv: str, as_json: bool = True):
        capsys.readouterr()
        code = cli_main.main(["--home", str(tmp_path / "home"), *argv, *(["--json"] if as_json else [])])
        out, err = capsys.readouterr()
        assert code == 0 and "Traceback" not in out + err
        return json.loads(out) if as_json else out

    for scheme in SCHEMES:
        tq("save", scheme, "--model", model, "--prompt", DOC, "--scheme", scheme)
    listed = {e["name"]: e for e in tq("ls")["entries"]}
    assert set(listed) == set(SCHEMES)
    for scheme in SCHEMES:
        quality = tq("info", scheme)["quality"]
        assert listed[scheme]["quality"] == quality
        assert quality["measured"] and quality["tokens"] == PROBE_TOKENS
        assert 0.0 < quality["kl"] < 1.0 and 0.0 <= quality["top1"] <= 1.0  # lossy, and far from collapse
        text = tq("info", scheme, as_json=False)
        line = next(line for line in text.splitlines() if line.strip().startswith("quality"))
        assert f"KL {quality['kl']:.4f}, top-1 {quality['top1']:.3f} over the last {PROBE_TOKENS} tokens" in line
