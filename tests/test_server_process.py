"""The test helper that starts a real server says why a server failed to start."""

import pytest

from server_process import ServerProcess


def test_a_server_that_exits_before_listening_reports_its_own_log(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    with pytest.raises(RuntimeError, match="did not start") as failure:
        ServerProcess(home, tmp_path / "model", "--no-such-flag")
    assert "--no-such-flag" in str(failure.value)
