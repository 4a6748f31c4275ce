"""`dilu invoke --timeout` is DILU_TIMEOUT; `dilu deploy --timeout` (the profile's wait, at least
1 s) reads DILU_DEPLOY_TIMEOUT, so an invoke's sub-second timeout in the environment does not
break a deploy."""
from __future__ import annotations

from click.testing import CliRunner

from dilu.cli.main import main


def test_an_invoke_timeout_in_the_environment_is_not_the_deploys(tmp_path):
    missing = str(tmp_path / "function.toml")
    res = CliRunner().invoke(main, ["deploy", missing], env={"DILU_TIMEOUT": "0.5"})
    assert res.exit_code == 2 and "--timeout" not in res.output, res.output  # the spec's error
    assert "function.toml" in res.output
    res = CliRunner().invoke(main, ["deploy", missing], env={"DILU_DEPLOY_TIMEOUT": "0.5"})
    assert res.exit_code == 2 and "DILU_DEPLOY_TIMEOUT" in res.output, res.output
    res = CliRunner().invoke(main, ["deploy", "--help"])
    assert "DILU_DEPLOY_TIMEOUT" in res.output
