"""The generated kernel text is pinned: every variant of the grid in `kernel_support.variants`
builds, in every dialect and translation unit, exactly the text recorded in its digest fixture
(a refactoring of the generators, such as moving kernel bodies into resource files, must not
change a byte of what NVRTC, Metal or the emulator compile)."""

import json

from kernel_support.variants import FIXTURE, digests


def test_every_variant_builds_the_recorded_text():
    recorded = json.loads(FIXTURE.read_text())
    built = digests()
    assert built.keys() == recorded.keys()
    changed = sorted(name for name in built if built[name] != recorded[name])
    assert not changed, f"{len(changed)} variants build other text, e.g. {changed[:5]}"


def test_every_kernel_source_file_ships_and_every_section_is_found():
    """The sources are package data: each file under `src/` matches a package-data pattern of
    pyproject.toml (so a wheel carries it) and parses into named sections."""
    import fnmatch
    import tomllib
    from pathlib import Path

    from turboquant.attention.kernels import dialects

    root = Path(__file__).resolve().parents[1]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "turboquant.attention.kernels"]
    src = Path(dialects.__file__).with_name("src")
    files = sorted(p.name for p in src.iterdir())
    assert files
    for name in files:
        assert any(fnmatch.fnmatch(f"src/{name}", pat) for pat in patterns), name
        assert dialects.sections(name), name
