"""The committed stubs are what scripts/gen-proto makes from proto/kvdepot.proto."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO


def test_committed_stubs_match_the_proto(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools is a test dependency: pip install -e .[test]")
    subprocess.run(
        ["bash", str(REPO / "scripts" / "gen-proto"), str(tmp_path)],
        check=True, env={**os.environ, "PYTHON": sys.executable},
    )
    for name in ("kvdepot_pb2.py", "kvdepot_pb2_grpc.py", "kvdepot_pb2.pyi"):
        generated = (tmp_path / name).read_text()
        committed = (REPO / "proto" / name).read_text()
        assert generated == committed, f"proto/{name} is stale: run scripts/gen-proto and commit the result"
