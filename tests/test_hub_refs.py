"""A model named by a Hugging Face repo id: entries record the id (not the hub cache's snapshot
folder), so another machine whose hub cache holds the repo finds the model without --model.

The hub cache is built here, offline: `models--owner--name/snapshots/<commit>` and `refs/main`,
with HF_HUB_OFFLINE set, so nothing is downloaded.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from model_folder import write_mlx_lm_cache, write_model_folder
from tqstore.models.loading import hub_repo
from test_cli import DOC, cli, clean_env, fails  # noqa: F401 - fixtures

REPO = "tiny-org/Tiny-4bit"
COMMIT = "68b62385" + "0" * 32


def hub_cache(root: Path, folder: Path, repo: str = REPO, commit: str = COMMIT) -> Path:
    """`root` as a hub cache holding `folder` as `repo` at `commit` (refs/main points at it)."""
    cached = root / ("models--" + repo.replace("/", "--"))
    (cached / "refs").mkdir(parents=True, exist_ok=True)
    (cached / "refs" / "main").write_text(commit)
    shutil.copytree(folder, cached / "snapshots" / commit)
    return root


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("hub-models")
    return write_model_folder(root / "tiny"), write_model_folder(root / "other", seed=5)


@pytest.fixture
def use_hub(monkeypatch):
    """use_hub(root): the hub cache this process resolves repo ids from, offline."""
    import huggingface_hub.constants as constants

    def use(root: Path) -> None:
        monkeypatch.setenv("HF_HUB_CACHE", str(root))
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    return use


def test_an_entry_saved_by_repo_id_records_the_id_and_is_asked_on_another_machine(cli, folders, use_hub, tmp_path):
    tiny, other = folders
    hub = hub_cache(tmp_path / "hub", tiny)
    use_hub(hub)
    cli("save", "doc", "--model", REPO, "--prompt", DOC, "-q")
    info = cli("info", "doc", "--json").json
    assert info["model_ref"] == REPO and info["model_source"] == REPO
    assert info["metadata"]["tqstore.model_revision"] == COMMIT
    assert COMMIT not in cli("info", "doc").out.replace(f"meta tqstore.model_revision: {COMMIT}", "")
    listed = cli("ls", "--json").json["entries"][0]
    assert (listed["model_ref"], listed["model_source"]) == (REPO, REPO)

    # Chat turns load the entry's model through the registry (its snapshot folder): still the id.
    cli("chat", "doc", "--max-tokens", "2", "-q", stdin="Who pays?\n")
    assert cli("info", "doc.turn-1", "--json").json["model_ref"] == REPO

    # Another machine: its own home, the repo in a hub cache somewhere else, this one gone.
    bundle = tmp_path / "doc.tqb"
    cli("export", "doc", str(bundle), "-q")
    moved = hub.rename(tmp_path / "hub-b")
    use_hub(moved)
    home_b = str(tmp_path / "home-b")
    cli("--home", home_b, "import", str(bundle), "doc", "-q")
    asked = cli("--home", home_b, "ask", "doc", "Who pays?", "--max-tokens", "2", "--json")
    assert asked.code == 0, asked.err
    assert asked.json["cached_tokens"] == info["tokens"]

    # A model with other weights: the message names the repo id, never the commit.
    line = fails(cli("--home", home_b, "ask", "doc", "Who pays?", "--max-tokens", "2", "--model", str(other)),
                 f"saved with another model ({REPO})")
    assert COMMIT[:8] not in line


def test_an_mlx_lm_prompt_cache_imported_by_repo_id_records_the_id(cli, folders, use_hub, tmp_path):
    tiny, _ = folders
    use_hub(hub_cache(tmp_path / "hub", tiny))
    file = tmp_path / "cache.safetensors"
    write_mlx_lm_cache(file, tiny, DOC)
    imported = cli("import", str(file), "doc", "--model", REPO, "--prompt", DOC, "-q")
    assert imported.code == 0, imported.err
    info = cli("info", "doc", "--json").json
    assert info["model_ref"] == REPO and info["metadata"]["tqstore.model_revision"] == COMMIT


def test_an_entry_recorded_by_another_machines_snapshot_folder_finds_the_repo_here(cli, folders, use_hub, tmp_path):
    """Entries saved before repo ids were recorded hold the saving machine's snapshot folder."""
    from tqstore.engine.engine import Engine

    tiny, _ = folders
    use_hub(hub_cache(tmp_path / "hub", tiny))
    cli("save", "doc", "--model", REPO, "--prompt", DOC, "-q")
    store = Engine.open(cli.home).store
    old_ref = f"/Users/someone/.cache/huggingface/hub/models--tiny-org--Tiny-4bit/snapshots/{COMMIT}"
    store.tiers.lmdb.put_manifest("doc", store.get("doc").replace(model_ref=old_ref).to_bytes())
    bundle = tmp_path / "doc.tqb"
    cli("export", "doc", str(bundle), "-q")
    home_b = str(tmp_path / "home-b")
    cli("--home", home_b, "import", str(bundle), "doc", "-q")
    assert cli("--home", home_b, "info", "doc", "--json").json["model_ref"] == old_ref
    asked = cli("--home", home_b, "ask", "doc", "Who pays?", "--max-tokens", "2", "--json")
    assert asked.code == 0, asked.err


def test_only_what_the_hub_cache_holds_is_recorded_by_repo_id(folders, tmp_path, monkeypatch):
    tiny, _ = folders
    snapshot = hub_cache(tmp_path / "hub", tiny) / "models--tiny-org--Tiny-4bit" / "snapshots" / COMMIT
    monkeypatch.chdir(tmp_path)
    assert hub_repo(REPO, snapshot) == (REPO, COMMIT)  # named by id, resolved by the hub
    assert hub_repo(str(snapshot), snapshot) == (REPO, COMMIT)  # the snapshot folder (how the registry finds it)
    assert hub_repo(str(tiny), tiny) is None  # a folder of one's own is recorded as a folder
    (tmp_path / "tiny-org" / "Tiny-4bit").mkdir(parents=True)
    assert hub_repo(REPO, tmp_path / REPO) is None  # an owner/name that is a folder here is that folder
