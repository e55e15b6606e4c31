"""The docs name what exists: every file they cite, and every Python name design.md cites.

A rename in the code that leaves the docs behind fails here, with the stale name."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

from conftest import REPO
from google.protobuf.descriptor import Descriptor

from kvdepot.proto import kvdepot_pb2 as pb

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
DESIGN = REPO / "docs" / "design.md"

# Folders of the product (and its tests and tools) whose paths the docs cite.
TOP = ("server", "client", "connector", "kvdepot", "proto", "bench", "tests", "scripts", "deploy", "docs")
# A path: a top folder, then more path, not itself inside a longer path or a URL.
PATH = re.compile(rf"(?<![\w./-])(?:{'|'.join(TOP)})/[\w.*/-]*[\w*/]")
# A relative markdown link's target.
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
# A file name in backticks (`depot.py`), with or without its folders.
FILE_NAME = re.compile(r"`([\w/.-]*\w\.(?:py|md|proto))`")
# A dotted Python name in backticks: `Depot.finish_job`, `KVDepotClient.open_session()`.
DOTTED = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?`")
# Dotted words that are file names (`depot.py`, `PATH.jobs`), not Python names.
FILE_SUFFIXES = {"py", "md", "proto", "toml", "json", "yaml", "env", "sock", "jobs", "pool", "service", "txt"}
# HTML comments: the options table's markers name the generator, which checks them itself.
COMMENT = re.compile(r"<!--.*?-->", re.S)

# What the docs cite of other projects: vLLM's, torch's and gRPC's names.
EXTERNAL_ROOTS = {"vllm", "torch", "grpc", "prometheus_client", "os"}
PRODUCT_FOLDERS = ("server", "client", "connector", "kvdepot", "proto", "bench", "scripts")


def product_files() -> list[Path]:
    return [p for folder in PRODUCT_FOLDERS for p in (REPO / folder).rglob("*.py") if "_pb2" not in p.name]


@cache
def python_names() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Members of each class (methods, class attributes, `self.x` assignments, and those of
    bases defined in the tree), and the top-level names of each module, by its stem."""
    classes: dict[str, set[str]] = {}
    bases: dict[str, set[str]] = {}
    modules: dict[str, set[str]] = {}
    for path in product_files():
        tree = ast.parse(path.read_text(), str(path))
        top = modules.setdefault(path.stem, set())
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                top.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                top.update(t.id for t in targets if isinstance(t, ast.Name))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                top.update((a.asname or a.name).split(".")[0] for a in node.names)
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            members = classes.setdefault(node.name, set())
            bases.setdefault(node.name, set()).update(b.id for b in node.bases if isinstance(b, ast.Name))
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    members.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    members.update(t.id for t in item.targets if isinstance(t, ast.Name))
            for sub in ast.walk(node):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self" \
                        and isinstance(sub.ctx, ast.Store):
                    members.add(sub.attr)
    for name in classes:
        for base in bases[name]:
            classes[name] |= classes.get(base, set())
    return classes, modules


def proto_messages() -> dict[str, Descriptor]:
    found = {}
    todo = list(pb.DESCRIPTOR.message_types_by_name.values())
    while todo:
        message = todo.pop()
        found[message.name] = message
        todo.extend(message.nested_types)
    return found


def module_file(parts: list[str]) -> tuple[Path | None, list[str]]:
    """`kvdepot.server.core.depot.Depot` -> (server/core/depot.py, ["Depot"])."""
    assert parts[0] == "kvdepot"
    for root in (REPO / "kvdepot", REPO):
        folder, rest = root, parts[1:]
        while rest and (folder / rest[0]).is_dir():
            folder, rest = folder / rest[0], rest[1:]
        if rest and (folder / f"{rest[0]}.py").is_file():
            return folder / f"{rest[0]}.py", rest[1:]
        if folder != root and not rest:
            return folder, []
    return None, parts[1:]


def dotted_name_problem(name: str) -> str | None:
    """Why `name` names nothing in the tree, or None when it does (or is another project's)."""
    classes, modules = python_names()
    messages = proto_messages()
    parts = name.split(".")
    if parts[-1].startswith("__") and parts[-1].endswith("__"):  # `kvdepot.__path__`: the module's own
        parts = parts[:-1]
        if len(parts) == 1:
            return None if parts[0] in modules or parts[0] == "kvdepot" else "no such module"
    head, rest = parts[0], parts[1:]
    if head in EXTERNAL_ROOTS:
        return None
    if head == "kvdepot":
        if name == "kvdepot.v1":  # the .proto's package
            return None
        path, rest = module_file(parts)
        if path is None:
            return "no such module"
        if rest and path.is_file() and rest[0] not in modules[path.stem]:
            return f"{path.relative_to(REPO)} defines no {rest[0]}"
        if len(rest) > 1 and rest[1] not in classes.get(rest[0], set()):
            return f"{rest[0]} has no member {rest[1]}"
        return None
    if head in classes:
        return None if rest[0] in classes[head] else f"class {head} has no member {rest[0]}"
    if head in messages:
        message = messages[head]
        known = set(message.fields_by_name) | {m.name for m in message.nested_types} | set(message.enum_values_by_name)
        return None if rest[0] in known else f"message {head} has no field {rest[0]}"
    if head in modules:
        return None if rest[0] in modules[head] else f"module {head} defines no {rest[0]}"
    return "no class, module or message of that name"


def cited_paths(doc: Path) -> set[str]:
    text = COMMENT.sub("", doc.read_text())
    paths = set(PATH.findall(text))
    for target in LINK.findall(text):
        if "://" not in target and not target.startswith("mailto:"):
            paths.add(str((doc.parent / target).resolve().relative_to(REPO.resolve())))
    return paths


def test_every_path_the_docs_cite_exists():
    missing, checked = [], 0
    for doc in DOCS:
        for cited in sorted(cited_paths(doc)):
            checked += 1
            found = list(REPO.glob(cited.rstrip("/"))) if "*" in cited else [REPO / cited]
            if not found or not all(p.exists() for p in found):
                missing.append(f"{doc.relative_to(REPO)}: {cited}")
    assert not missing, "the docs cite paths that do not exist:\n" + "\n".join(missing)
    assert checked >= 80, f"only {checked} paths found in the docs: is the pattern still right?"


def test_every_file_name_design_md_cites_exists():
    text = DESIGN.read_text()
    names = set(FILE_NAME.findall(text))
    everything = {str(p.relative_to(REPO)) for p in REPO.rglob("*") if ".git" not in p.parts}
    missing = sorted(n for n in names if not any(p == n or p.endswith("/" + n) for p in everything))
    assert not missing, "docs/design.md cites files that do not exist: " + ", ".join(missing)
    assert len(names) >= 40, f"only {len(names)} file names found in docs/design.md"


def test_every_python_name_design_md_cites_exists():
    names = {n for n in DOTTED.findall(DESIGN.read_text()) if n.rsplit(".", 1)[1] not in FILE_SUFFIXES}
    problems = [f"`{n}`: {why}" for n in sorted(names) if (why := dotted_name_problem(n))]
    assert not problems, "docs/design.md cites names that do not exist:\n" + "\n".join(problems)
    assert len(names) >= 15, f"only {len(names)} dotted names found in docs/design.md"


def test_the_name_check_can_fail():
    assert dotted_name_problem("Depot.finish_job") is None
    assert dotted_name_problem("Depot.no_such_method") is not None
    assert dotted_name_problem("KVDepotClient.begin_store") is not None
    assert dotted_name_problem("NoSuchClass.method") is not None
    assert dotted_name_problem("TensorSpec.byte_offset") is None
    assert dotted_name_problem("kvdepot.server.core.depot.Depot") is None
    assert dotted_name_problem("kvdepot.server.core.nothing") is not None
