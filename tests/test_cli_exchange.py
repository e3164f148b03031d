"""`tqstore export` / `tqstore import` refusing what would store a wrong or dead entry: a --prompt
other than the text an exported mlx-lm file records, an expired entry, options a bundle has no use
for. The commands run in-process (`main(argv)`, as in test_cli.py) on real homes and files."""

from __future__ import annotations

import time

import pytest

from model_folder import write_model_folder
from test_cli import clean_env, cli, fails  # noqa: F401 (fixtures)

DOC = ("The Devil's Dictionary defines words with wit. To abscond is to move in a mysterious way, "
       "commonly with the property of another.")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(write_model_folder(tmp_path_factory.mktemp("model") / "tiny-qwen2", num_hidden_layers=2))


def framed(model: str, text: str) -> list[int]:
    """The tokens `save --prompt text` stores: the user turn left open, as mlx_lm.cache_prompt frames it."""
    from mlx_lm import load

    _, tokenizer = load(model)
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=False,
                                         continue_final_message=True)


def test_import_refuses_a_prompt_other_than_the_text_the_file_records(cli, model, tmp_path):
    cli("save", "doc", "--model", model, "--prompt", DOC, "--scheme", "raw", "-q")
    file = tmp_path / "doc.safetensors"
    cli("export", "doc", str(file), "--mlx-lm", "-q")
    # Two words swapped: as many tokens, so the token count alone cannot tell the texts apart.
    other = DOC.replace("words with wit", "wit with words")
    tokens, other_tokens = framed(model, DOC), framed(model, other)
    assert len(other_tokens) == len(tokens) and other_tokens != tokens
    home = str(tmp_path / "other-home")

    line = fails(cli("--home", home, "import", str(file), "wrong", "--model", model, "--prompt", other),
                 "not the one")
    first = next(i for i, (a, b) in enumerate(zip(tokens, other_tokens)) if a != b)
    assert f"token {first} of {len(tokens)}" in line and "exact text the cache was made from" in line
    assert cli("--home", home, "ls", "--json").json["entries"] == []
    # Its K/V stored under that text's tokens would be reused by a later save of it.
    saved = cli("--home", home, "save", "other", "--model", model, "--prompt", other, "--json").json
    assert saved["reused_tokens"] == 0

    imported = cli("--home", home, "import", str(file), "right", "--model", model, "--prompt", DOC, "--json").json
    assert imported["tokens"] == len(tokens)
    assert cli("--home", home, "info", "right", "--json").json["tokens"] == len(tokens)


def test_import_of_a_bundle_refuses_the_options_of_mlx_lm_files(cli, model, tmp_path):
    cli("save", "doc", "--model", model, "--prompt", DOC, "-q")
    bundle = tmp_path / "doc.tqb"
    cli("export", "doc", str(bundle), "-q")
    # A bundle holds its own tokens: a system prompt given for it was silently ignored.
    for option in (["--system", "hi"], ["--model", model], ["--scheme", "raw"], ["--prompt", DOC]):
        fails(cli("import", str(bundle), "copy", *option), "a bundle is imported as it is")
    assert [e["name"] for e in cli("ls", "--json").json["entries"]] == ["doc"]


def test_an_expired_entry_is_not_exported(cli, model, tmp_path):
    cli("save", "short", "--model", model, "--prompt", DOC, "--scheme", "raw", "--ttl", "1s", "-q")
    cli("save", "kept", "--model", model, "--prompt", DOC + " Kept.", "--ttl", "1s", "--pin", "-q")
    time.sleep(1.1)
    # Exported, it would be an entry no store uses, deleted by the next gc there.
    fails(cli("export", "short", str(tmp_path / "short.tqb")), "expired at")
    fails(cli("export", "short", str(tmp_path / "short.safetensors"), "--mlx-lm"), "expired at")
    # Pinned, it is live here; the bundle would carry the TTL without the pin.
    fails(cli("export", "kept", str(tmp_path / "kept.tqb")), "a bundle does not carry the pin")
    assert not any(p.name.startswith(("short", "kept")) for p in tmp_path.iterdir())
    cli("save", "kept", "--model", model, "--prompt", DOC + " Kept.", "-q")  # what the refusal advises
    assert cli("export", "kept", str(tmp_path / "kept.tqb"), "--json").json["name"] == "kept"


def test_a_bundle_whose_entry_expired_is_not_imported(cli, model, tmp_path):
    from tqstore.exchange.bundle import read_bundle, write_bundle
    from tqstore.format.manifest import Manifest

    cli("save", "doc", "--model", model, "--prompt", DOC, "--ttl", "1h", "-q")
    bundle = tmp_path / "doc.tqb"
    cli("export", "doc", str(bundle), "-q")
    # Its TTL ran out since the export (without waiting an hour): the import reported success, then gc deleted it.
    manifest_bytes, objects = read_bundle(bundle)
    write_bundle(bundle, Manifest.from_bytes(manifest_bytes).replace(expires=time.time() - 1).to_bytes(), objects)
    home = str(tmp_path / "other-home")
    fails(cli("--home", home, "import", str(bundle), "doc"), "expired at")
    assert cli("--home", home, "ls", "--json").json["entries"] == []


def test_an_imported_mlx_lm_file_gets_a_quality_receipt(cli, model, tmp_path):
    """Before: "not measured" for every import, although the file's uncompressed caches are the
    very reference a receipt needs; an import compressed with --scheme gave no signal of its cost."""
    doc = " ".join([DOC] * 4)  # longer than the probe
    cli("save", "doc", "--model", model, "--prompt", doc, "--scheme", "raw", "-q")
    file = tmp_path / "doc.safetensors"
    cli("export", "doc", str(file), "--mlx-lm", "-q")
    home = str(tmp_path / "other-home")
    for name, scheme in (("as-raw", []), ("as-turbo4", ["--scheme", "turbo4"])):
        assert cli("--home", home, "import", str(file), name, "--model", model, *scheme, "-q").code == 0
    raw, turbo = (cli("--home", home, "info", n, "--json").json["quality"] for n in ("as-raw", "as-turbo4"))
    assert raw["measured"] and raw["kl"] == 0 and raw["top1"] == 1 and raw["tokens"] == 32
    assert turbo["measured"] and 0 < turbo["kl"] < 1 and 0 <= turbo["top1"] <= 1 and turbo["tokens"] == 32
    assert "KL" in cli("--home", home, "info", "as-turbo4").out


def test_an_mlx_lm_file_compressed_at_import_is_the_entry_a_save_stores(cli, model, tmp_path):
    """Before: an import calibrated on the keys alone (no queries in the file), so its first
    block differed from a save's of the same text: the import into a store holding that save
    was refused as another save of the same first tokens (ConflictError), and elsewhere it
    cost what a save would not. It now observes the queries a prefill does (a forward of at
    most 256 tokens): on this model its blocks are the save's (a real model's can differ by
    rounding, docs/quality.md)."""
    doc = " ".join([DOC] * 12)  # past one block
    cli("save", "raw", "--model", model, "--prompt", doc, "--scheme", "raw", "-q")
    file = tmp_path / "doc.safetensors"
    cli("export", "raw", str(file), "--mlx-lm", "-q")
    cli("save", "saved", "--model", model, "--prompt", doc, "--scheme", "turbo4", "-q")
    imported = cli("import", str(file), "imported", "--model", model, "--scheme", "turbo4", "--json")
    assert imported.code == 0 and imported.json["blocks"] >= 2 and imported.json["new_blocks"] == 0
    saved, again = (cli("info", n, "--json").json["quality"] for n in ("saved", "imported"))
    assert again["kl"] == saved["kl"] and again["top1"] == saved["top1"]
