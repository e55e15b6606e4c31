"""The connector's vLLM checks: a version it was not tested with is named at start-up, and a
vLLM internal it needs that is missing stops the engine at start-up, with a message saying which."""

from __future__ import annotations

import logging

import pytest
from vllm_engine import DAEMON_OPTIONS, make_engine

pytestmark = pytest.mark.vllm


@pytest.fixture
def vllm_compat():
    # Imported here, not at collection: it imports vLLM, which `pytest -m cuda` on a GPU machine lacks.
    from kvdepot.connector import vllm_compat

    return vllm_compat


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0", "0.33.2.dev14+g1234abc"])
def test_supported_versions_start_quietly(version, caplog, vllm_compat):
    with caplog.at_level(logging.WARNING, logger="kvdepot.connector"):
        assert vllm_compat.check_version(version)
    assert not caplog.records


@pytest.mark.parametrize("version", ["0.31.4", "0.34.0", "1.0.0", "unknown"])
def test_other_versions_get_a_warning_naming_the_supported_ones(version, caplog, vllm_compat):
    with caplog.at_level(logging.WARNING, logger="kvdepot.connector"):
        assert not vllm_compat.check_version(version)
    (record,) = caplog.records
    assert version in record.getMessage() and "vLLM 0.32 and 0.33" in record.getMessage()


def test_the_connector_checks_the_version_when_it_is_made(start_daemon, monkeypatch, caplog):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.30.1")
    with caplog.at_level(logging.WARNING, logger="kvdepot.connector"):
        engine = make_engine(start_daemon(**DAEMON_OPTIONS))
    engine.close()
    # The scheduler's connector and the worker's.
    warnings = [r for r in caplog.records if "0.30.1" in r.getMessage()]
    assert len(warnings) == 2 and "vLLM 0.32 and 0.33" in warnings[0].getMessage()


def test_a_missing_internal_stops_the_engine_at_start_up(start_daemon, monkeypatch, vllm_compat):
    import vllm.v1.core.kv_cache_utils as kv_cache_utils

    # KV events publish vLLM's own block hashes, converted as vLLM converts them.
    monkeypatch.delattr(kv_cache_utils, "maybe_convert_block_hash")
    daemon = start_daemon(**DAEMON_OPTIONS)
    with pytest.raises(vllm_compat.VllmCompatError, match=r"maybe_convert_block_hash \(KV events.*vLLM 0.32 and 0.33"):
        make_engine(daemon, kv_events=True)
    # Without events the connector does not need it.
    make_engine(daemon).close()


def test_a_missing_scheduler_output_field_stops_the_engine_at_start_up(start_daemon, monkeypatch, vllm_compat):
    import dataclasses

    from vllm.v1.core.sched import output

    # A CachedRequestData without resumed_req_ids: a resumed request's new block
    # list would be taken as more blocks, and stores would read the wrong ones.
    fields = [(f.name, f.type) for f in dataclasses.fields(output.CachedRequestData) if f.name != "resumed_req_ids"]
    monkeypatch.setattr(output, "CachedRequestData", dataclasses.make_dataclass("CachedRequestData", fields))
    with pytest.raises(vllm_compat.VllmCompatError, match="CachedRequestData.resumed_req_ids"):
        make_engine(start_daemon(**DAEMON_OPTIONS))
