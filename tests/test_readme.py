"""The README's promises: its set-up commands exist, and the docs document every option
(the daemon's in docs/configuration.md, the connector's in the README)."""

from __future__ import annotations

import re

from conftest import REPO

from kvdepot.server.daemon.options import OPTIONS


def test_configuration_doc_documents_every_daemon_option():
    doc = (REPO / "docs" / "configuration.md").read_text()
    for option in OPTIONS:
        assert f"`{option.flag}`" in doc, f"docs/configuration.md does not document {option.flag}"


def test_readme_documents_every_connector_setting():
    from kvdepot.connector.config import EXTRA_CONFIG_KEYS, PARAM_LOAD, PARAM_STORE, PARAM_STORE_DECODE

    readme = (REPO / "README.md").read_text()
    for key in EXTRA_CONFIG_KEYS:
        assert f"| `{key}` |" in readme, f"README.md does not document the connector setting {key}"
    for param in (PARAM_STORE, PARAM_STORE_DECODE, PARAM_LOAD):
        assert f'"{param}"' in readme, f"README.md does not document the request parameter {param}"


def test_readme_set_up_commands_are_make_targets_and_ci_runs_the_test_one():
    readme = (REPO / "README.md").read_text()
    makefile = (REPO / "Makefile").read_text()
    for target in ("run", "test"):
        assert f"    make {target}\n" in readme
        assert re.search(rf"^{target}:", makefile, re.M)
    assert "make test" in (REPO / ".ci" / "run").read_text()
