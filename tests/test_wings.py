"""The daemon's wings keep their rules (docs/design.md): imports point down,
protobuf is read and built in the API wing alone, nothing imports the daemon
wing, there is no import cycle, and no file of the product grows past about
450 lines."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Folder of the checkout -> the package it installs as.
PACKAGES = {"kvdepot": "kvdepot", "proto": "kvdepot.proto", "server": "kvdepot.server",
            "client": "kvdepot.client", "connector": "kvdepot.connector",
            "sglang_backend": "kvdepot.sglang_backend"}
GENERATED = {"proto/kvdepot_pb2.py", "proto/kvdepot_pb2_grpc.py"}
MAX_LINES = 460


def _module(path: Path) -> str:
    relative = path.relative_to(REPO)
    parts = [PACKAGES[relative.parts[0]], *relative.parts[1:]]
    parts[-1] = parts[-1][: -len(".py")]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    return {
        _module(path): path
        for folder in PACKAGES
        for path in (REPO / folder).rglob("*.py")
        if str(path.relative_to(REPO)) not in GENERATED
    }


def _type_checking_only(tree: ast.AST) -> set[ast.AST]:
    """Import nodes under `if TYPE_CHECKING:`, which never run."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING":
            for child in node.body:
                skipped.update(ast.walk(child))
    return skipped


def _imports(path: Path) -> set[str]:
    """Every module `path` imports when it runs, at any depth (imports inside
    functions count); `from package import module` names the module alone."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = _type_checking_only(tree)
    names = set()
    for node in ast.walk(tree):
        if node in skipped:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & SOURCES.keys()
            names.update(submodules or {node.module})
    return names


SOURCES = _sources()
IMPORTS = {module: _imports(path) for module, path in SOURCES.items()}


def _wing(module: str) -> str | None:
    if module == "kvdepot.server.__main__":  # `python -m kvdepot.server` starts the daemon
        return "daemon"
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "server" else None


# What each wing of server/ may import of the others.
ALLOWED = {
    "host": {"host"},
    "core": {"core", "host"},
    "tiers": {"tiers", "core", "host"},
    "transports": {"transports", "core", "host"},
    "api": {"api", "core", "host"},
    "native": {"native", "core", "host"},
    "daemon": {"daemon", "api", "core", "host", "tiers", "transports", "native"},
}


def test_every_server_module_is_in_a_wing():
    loose = [m for m in SOURCES if m.startswith("kvdepot.server.") and _wing(m) not in ALLOWED]
    assert not loose, f"modules outside the wings of server/: {loose}"
    assert len([m for m in SOURCES if _wing(m)]) >= 30


def test_wings_import_only_downward():
    wrong = []
    for module, names in IMPORTS.items():
        for name in names:
            target = _wing(name)
            if target is None or not name.startswith("kvdepot.server."):
                continue
            source = _wing(module)
            if source is None:
                wrong.append(f"{module} (outside the daemon) imports {name}")
            elif source is not None and target not in ALLOWED[source]:
                wrong.append(f"{module} ({source}/) imports {name} ({target}/)")
    assert not wrong, "\n".join(sorted(wrong))


def test_protobuf_and_prometheus_stay_out_of_the_core_and_below():
    wrong = [
        f"{module} imports {name}"
        for module, names in IMPORTS.items()
        if _wing(module) in ("core", "host", "tiers", "transports", "native")
        for name in names
        if name.startswith(("kvdepot.proto", "google.protobuf", "prometheus_client", "grpc"))
    ]
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_cycle():
    graph = {m: {n for n in names if n in SOURCES and n != m} for m, names in IMPORTS.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in graph[module]:
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_cycle():
    """The check above is not vacuous: the import graph it walks has edges."""
    assert sum(len(names & SOURCES.keys()) for names in IMPORTS.values()) > 100


def test_no_file_of_the_product_is_much_over_450_lines():
    long = {str(p.relative_to(REPO)): n for p in SOURCES.values() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"
