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
