"""kvdepot as SGLang's HiCache storage backend (sglang_backend/), driven through
SGLang's own classes: the instances are processes of the SGLang environment
(.venv-sglang, made by `make test`) that build the backend with SGLang's
StorageBackendFactory from the README's extra config, against a real daemon.
What runs only on a GPU node (SGLang's host pool and cache controller, which
import its CUDA stack) is said in the README's SGLang section."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import subprocess_env, wait_until

REPO = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
SGLANG_PYTHON = Path(os.environ.get("KVDEPOT_SGLANG_PYTHON", REPO / ".venv-sglang" / "bin" / "python"))
NOBODY = 65534

_no_sglang = pytest.mark.skipif(
    not SGLANG_PYTHON.exists(), reason=f"no SGLang environment at {SGLANG_PYTHON} (make test makes it)"
)


def needs_sglang(test):
    """Runs SGLang instances (marked sglang: make test runs them on the native lane only)."""
    return pytest.mark.sglang(_no_sglang(test))


def readme_command() -> tuple[str, dict]:
    """The README's sglang.launch_server command line, and its backend's extra config."""
    text = (REPO / "README.md").read_text()
    [block] = re.findall(r"```sh\n(python -m sglang\.launch_server[^`]*?)```", text)
    [extra] = re.findall(r"--hicache-storage-backend-extra-config '(\{.*?\})'", block)
    return block, json.loads(extra)


def instance(daemon_socket: str, mode: str, layout: str = "page_first", prompt: int = 1, pages: int = 6,
             mla: bool = False, tp: tuple[int, int] = (0, 1), as_uid: int | None = None,
             model: dict | None = None) -> dict:
    """`model`: SGLang's published model settings (model_path, kv_cache_dtype, ...)."""
    _, extra = readme_command()
    prefix = ["setpriv", f"--reuid={as_uid}", f"--regid={as_uid}", "--clear-groups", "--"] if as_uid else []
    env = subprocess_env()
    if model:
        env["KVDEPOT_TEST_SGLANG_MODEL"] = json.dumps(model)
    if as_uid:
        home = Path(tempfile.mkdtemp(prefix="kvdepot-sglang-home-"))
        home.chmod(0o777)  # torch writes its caches under $HOME
        env["HOME"] = str(home)
    result = subprocess.run(
        [*prefix, str(SGLANG_PYTHON), str(HERE / "sglang_instance.py"), daemon_socket, json.dumps(extra), mode,
         layout, "1" if mla else "0", str(prompt), str(pages), str(tp[0]), str(tp[1])],
        capture_output=True, text=True, timeout=120, env=env, cwd="/",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_readme_launches_sglang_with_this_backend():
    command, extra = readme_command()
    assert "--enable-hierarchical-cache" in command and "--hicache-storage-backend dynamic" in command
    assert extra["module_path"] == "kvdepot.sglang_backend" and extra["class_name"] == "KVDepotStorage"
    assert extra.get("interface_v1") == 1  # SGLang calls the zero-copy batch_get_v1/batch_set_v1 only then


@needs_sglang
def test_the_readmes_launch_flags_are_sglangs():
    command, _ = readme_command()
    found = subprocess.run(
        [str(SGLANG_PYTHON), "-c", "from sglang.srt.server_args import ServerArgs; "
         "print(' '.join(ServerArgs.__struct_fields__))"],
        capture_output=True, text=True, timeout=120, env=subprocess_env(),
    )
    assert found.returncode == 0, found.stderr[-2000:]
    fields = set(found.stdout.split())
    flags = set(re.findall(r"(?<![\w-])--([a-z][a-z0-9-]*)", command))
    assert flags and {f.replace("-", "_") for f in flags} <= fields


@needs_sglang
@pytest.mark.parametrize("layout, mla", [
    ("page_first", False), ("layer_first", False), ("page_first_direct", False), ("page_head", False),
    ("page_first", True), ("layer_first", True),
])
def test_two_instances_share_pages_through_one_daemon_bytes_exact(start_daemon, layout, mla):
    daemon = start_daemon()
    stored = instance(daemon.socket, "store", layout, prompt=11, mla=mla)
    assert stored["backend"] == "KVDepotStorage" and stored["set"] == [True] * 6
    loaded = instance(daemon.socket, "load", layout, prompt=11, mla=mla)
    assert loaded["exists"] == 6
    assert loaded["got"] == [True] * 6 and loaded["equal"] == [True] * 6
    # A prompt nobody stored: no pages, no exception.
    other = instance(daemon.socket, "load", layout, prompt=12, mla=mla)
    assert other["exists"] == 0 and other["got"] == [False] * 6


@needs_sglang
def test_a_prefix_is_counted_up_to_the_first_missing_page(start_daemon):
    daemon = start_daemon()
    assert instance(daemon.socket, "store", prompt=21, pages=3)["set"] == [True] * 3
    # The same prompt, longer: its first 3 pages have the same SGLang keys.
    longer = instance(daemon.socket, "load", prompt=21, pages=6)
    assert longer["exists"] == 3
    assert longer["got"] == [True] * 3 + [False] * 3 and longer["equal"][:3] == [True] * 3


@needs_sglang
def test_the_generic_get_and_set_path_moves_the_same_pages(start_daemon):
    daemon = start_daemon()
    assert instance(daemon.socket, "store_generic", "page_first", prompt=31)["set"] == [True] * 6
    # Stored one flat page at a time, loaded by the zero-copy path, and the other way round.
    assert instance(daemon.socket, "load", "page_first", prompt=31)["equal"] == [True] * 6
    assert instance(daemon.socket, "store", "layer_first", prompt=32)["set"] == [True] * 6
    generic = instance(daemon.socket, "load_generic", "layer_first", prompt=32)
    assert generic["got"] == [True] * 6 and generic["equal"] == [True] * 6


@needs_sglang
def test_pages_of_another_layout_model_shape_or_tp_size_are_never_served(start_daemon):
    daemon = start_daemon()
    instance(daemon.socket, "store", "page_first", prompt=41)
    assert instance(daemon.socket, "exists", "layer_first", prompt=41)["exists"] == 0
    assert instance(daemon.socket, "exists", "page_first", prompt=41, mla=True)["exists"] == 0
    # TP 2: a page is served only once both ranks stored their shard.
    assert instance(daemon.socket, "exists", "page_first", prompt=41, tp=(0, 2))["exists"] == 0
    instance(daemon.socket, "store", "page_first", prompt=42, tp=(0, 2))
    assert instance(daemon.socket, "exists", "page_first", prompt=42, tp=(0, 2))["exists"] == 0
    instance(daemon.socket, "store", "page_first", prompt=42, tp=(1, 2))
    assert instance(daemon.socket, "load", "page_first", prompt=42, tp=(1, 2))["equal"] == [True] * 6


@needs_sglang
def test_the_namespace_names_the_weights_and_kv_format_not_the_served_name(start_daemon, tmp_path):
    """SGLang's storage config names the model by --served-model-name and keeps every fp8
    format as uint8: the backend names the weights and the KV dtype from SGLang's model settings."""
    daemon = start_daemon()
    weights = {}
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
        (tmp_path / name / "model.safetensors").write_bytes(os.urandom(4096))
        weights[name] = {"model_path": str(tmp_path / name), "kv_cache_dtype": "fp8_e4m3"}
    assert instance(daemon.socket, "store", prompt=45, model=weights["a"])["set"] == [True] * 6
    assert instance(daemon.socket, "load", prompt=45, model=weights["a"])["equal"] == [True] * 6
    # Other weights served under the same name, and the same weights with another fp8 format.
    assert instance(daemon.socket, "exists", prompt=45, model=weights["b"])["exists"] == 0
    e5m2 = {**weights["a"], "kv_cache_dtype": "fp8_e5m2"}
    assert instance(daemon.socket, "exists", prompt=45, model=e5m2)["exists"] == 0


@needs_sglang
def test_clear_empties_the_instances_pages(start_daemon):
    daemon = start_daemon()
    instance(daemon.socket, "store", prompt=51)
    assert instance(daemon.socket, "clear", prompt=51)["cleared"] is True
    assert instance(daemon.socket, "exists", prompt=51)["exists"] == 0


@needs_sglang
def test_a_dead_daemon_is_a_miss_never_an_exception(start_daemon, tmp_path):
    nowhere = instance(str(tmp_path / "no-daemon.sock"), "load", prompt=61)
    assert nowhere["exists"] == 0 and nowhere["got"] == [False] * 6
    daemon = start_daemon()
    instance(daemon.socket, "store", prompt=62)
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait(10)
    killed = instance(daemon.socket, "load", prompt=62)
    assert killed["exists"] == 0 and killed["got"] == [False] * 6
    assert instance(daemon.socket, "store", prompt=63)["set"] == [False] * 6


@needs_sglang
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_an_instance_of_another_uid_shares_nothing(open_folder, start_daemon):
    daemon = start_daemon(folder=open_folder)
    for path in (daemon.socket, daemon.socket + ".jobs"):
        os.chmod(path, 0o666)
    assert instance(daemon.socket, "store", prompt=71)["set"] == [True] * 6
    other = instance(daemon.socket, "load", prompt=71, as_uid=NOBODY)
    assert other["exists"] == 0 and other["got"] == [False] * 6
    # Nor does its store of the same keys reach the first uid's instance.
    assert instance(daemon.socket, "store", prompt=72, as_uid=NOBODY)["set"] == [True] * 6
    assert instance(daemon.socket, "exists", prompt=72)["exists"] == 0


# ---------------------------------------------------------------- host pages, without SGLang


def test_a_host_pools_pages_are_viewed_in_sglangs_flat_page_order():
    from kvdepot.sglang_backend.host_pages import host_pages

    class Pool:
        page_size = 4

        def get_data_page(self, index, flat=True):
            page = self.page_of(self.kv_buffer, index // 4)
            return page.flatten() if flat else page

    for layout, dims, page_of in [
        ("layer_first", (2, 3, 32, 2, 8), lambda b, i: b[:, :, i * 4 : i * 4 + 4]),
        ("page_first", (2, 32, 3, 2, 8), lambda b, i: b[:, i * 4 : i * 4 + 4]),
        ("page_first_direct", (2, 8, 3, 4, 2, 8), lambda b, i: b[:, i : i + 1]),
    ]:
        pool = Pool()
        pool.layout, pool.kv_buffer = layout, torch.arange(torch.Size(dims).numel(), dtype=torch.float32).view(dims)
        pool.page_of = page_of
        pages = host_pages(pool, mla=False)
        assert pages.num_pages == 8
        for i in (0, 5, 7):
            assert torch.equal(pages.page(i).flatten(), page_of(pool.kv_buffer, i).flatten())
            assert pages.page(i).data_ptr() != 0  # a view, not a copy:
            pages.page(i).zero_()
            assert not page_of(pool.kv_buffer, i).any()


def test_layouts_and_indices_kvdepot_cannot_serve_are_refused_with_the_reason():
    from kvdepot.errors import InvalidArgument
    from kvdepot.sglang_backend.host_pages import host_pages, page_ids

    class Pool:
        page_size, layout, kv_buffer = 4, "page_first_kv_split", torch.zeros(2, 32, 3, 2, 8)

    with pytest.raises(InvalidArgument, match="not 'page_first_kv_split'.*--hicache-mem-layout"):
        host_pages(Pool(), mla=False)
    Pool.layout, Pool.kv_buffer = "page_first", [torch.zeros(1)]
    with pytest.raises(InvalidArgument, match="not one tensor"):
        host_pages(Pool(), mla=False)
    # A pool of another class under a known layout name: refused, not stored as wrong bytes.
    Pool.layout, Pool.kv_buffer = "layer_first", torch.zeros(3, 8, 4 * 2 * 8)  # [layers, pages, row bytes]
    with pytest.raises(InvalidArgument, match="not the 5 dimensions"):
        host_pages(Pool(), mla=False)
    Pool.kv_buffer = torch.zeros(2, 3, 32, 2, 8)
    Pool.get_data_page = lambda self, index, flat=True: self.kv_buffer[:, :, index + 1 : index + 5]
    with pytest.raises(InvalidArgument, match="lays its pages out otherwise"):
        host_pages(Pool(), mla=False)
    pages = torch.arange(8, 16)
    assert page_ids(pages, 2, 4, 8) == [2, 3]
    assert page_ids(pages + 1, 2, 4, 8) is None  # not page-aligned
    assert page_ids(torch.tensor([0, 1, 3, 2]), 1, 4, 8) is None  # not a page in order
    assert page_ids(torch.arange(32, 36), 1, 4, 8) is None  # past the pool
    assert page_ids(pages, 3, 4, 8) is None  # fewer indices than pages


@needs_sglang
def test_an_instance_on_another_node_gets_the_pages_through_the_remote_tier(start_daemon, tmp_path):
    pytest.importorskip("glide", reason="the remote tier's client: pip install -e '.[remote]'")
    from test_remote_tier import node, remote
    from valkey_cluster import ValkeyCluster

    from kvdepot.client import KVDepotClient

    cluster = ValkeyCluster()
    try:
        node_a = node(start_daemon, tmp_path, cluster, "a")
        assert instance(node_a.socket, "store", prompt=31)["set"] == [True] * 6
        with KVDepotClient(node_a.socket, name="test") as a:
            a.connect(10)
            wait_until(lambda: remote(a.stats()).written_shards >= 6, what="node A's pages published")
        node_b = node(start_daemon, tmp_path, cluster, "b")
        loaded = instance(node_b.socket, "load", prompt=31)
        assert loaded["exists"] == 6 and loaded["got"] == [True] * 6 and loaded["equal"] == [True] * 6
        with KVDepotClient(node_b.socket, name="test") as b:
            assert remote(b.connect(10).stats()).promotions == 6
        # A prompt no node stored: a miss, no exception.
        assert instance(node_b.socket, "load", prompt=32)["exists"] == 0
    finally:
        cluster.stop()
