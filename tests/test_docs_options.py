"""The docs say what the daemon's option table (server/daemon/options.py) says:
the marked option tables are the generator's output, every daemon flag they
name exists, and every default they state is the table's."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest
from conftest import REPO, subprocess_env

from kvdepot.server.daemon import options_doc
from kvdepot.server.daemon.options import BY_KEY, OPTIONS
from kvdepot.server.daemon.options_doc import BEGIN_MARK, END_MARK
from kvdepot.settings import ConfigError, parse_size

DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])
DAEMON_FLAGS = {opt.flag for opt in OPTIONS} | {"--help"}

# Flags of other programs that the docs show: vLLM's, docker's, pip's and systemctl's.
FOREIGN_FLAGS = {
    "--gpu-memory-utilization", "--kv-transfer-config", "--kv-events-config",
    "--build-arg", "--shm-size",
    "--no-deps", "--only-binary", "--python-version", "--platform", "--no-index", "--target",
    "--now", "--from-literal",
    # sglang.launch_server's (tests/test_sglang_backend.py checks them against SGLang's own fields)
    "--model-path", "--enable-hierarchical-cache", "--hicache-mem-layout", "--hicache-storage-backend",
    "--hicache-storage-backend-extra-config", "--hicache-io-backend", "--kv-cache-dtype", "--served-model-name",
}  # fmt: skip
# Daemon options that the upgrade notes name as removed.
REMOVED_FLAGS = {"--pool-uids", "--job-deadline"}

FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*(?:\*)?")


def _parser_flags(parser: argparse.ArgumentParser) -> set[str]:
    flags = set()
    for action in parser._actions:
        flags.update(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags |= _parser_flags(sub)
    return flags


def _bench_flags() -> set[str]:
    """Flags the bench scripts and test helpers declare (they are not all importable here)."""
    found = set()
    for path in [*(REPO / "bench").glob("*.py"), *(REPO / "tests").glob("*.py")]:
        for call in re.finditer(r"add_argument\(([^)]*)", path.read_text()):
            found.update(re.findall(r"[\"'](--[a-z0-9-]+)[\"']", call.group(1)))
    return found


def _flags_in(text: str) -> set[str]:
    return set(FLAG.findall(text))


def test_every_marked_option_table_is_what_the_generator_writes():
    marked = options_doc.marked_files(REPO)
    assert marked, f"no doc of README.md or docs/*.md has the marker {BEGIN_MARK}"
    table = options_doc.markdown()
    for path in DOCS:
        text = path.read_text()
        assert text.count(BEGIN_MARK) == text.count(END_MARK), f"{path.name}: the OPTIONS TABLE markers do not pair"
        assert options_doc.rewrite(text, table) == text, (
            f"{path.name}'s option table is not what server/daemon/options.py says: run scripts/gen-options-doc"
        )


def test_the_generator_rewrites_a_stale_table(tmp_path):
    (tmp_path / "docs").mkdir()
    doc = tmp_path / "docs" / "configuration.md"
    doc.write_text(f"# Options\n\n{BEGIN_MARK}\n| `--pool-size` | `256MiB` | stale |\n{END_MARK}\n\nAfter.\n")
    (tmp_path / "README.md").write_text("No table here.\n")
    proc = subprocess.run([str(REPO / "scripts" / "gen-options-doc"), str(tmp_path)], capture_output=True, text=True,
                          env=subprocess_env(PYTHON=sys.executable), timeout=60)
    # The script rewrites the checkout it belongs to; the module takes any folder.
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([sys.executable, "-m", "kvdepot.server.daemon.options_doc", "--write", str(tmp_path)],
                          capture_output=True, text=True, env=subprocess_env(), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert doc.read_text() == f"# Options\n\n{BEGIN_MARK}\n{options_doc.markdown()}{END_MARK}\n\nAfter.\n"
    assert (tmp_path / "README.md").read_text() == "No table here.\n"


def test_every_flag_the_docs_name_is_an_option_of_what_they_run():
    from kvdepot.client.cli import build_parser as cli_parser

    known = DAEMON_FLAGS | _parser_flags(cli_parser()) | _bench_flags() | FOREIGN_FLAGS | REMOVED_FLAGS
    assert not (REMOVED_FLAGS & DAEMON_FLAGS), "a flag the docs call removed is an option again"
    for path in DOCS:
        for flag in sorted(_flags_in(path.read_text())):
            if flag.endswith("*"):
                assert any(f.startswith(flag[:-1]) for f in DAEMON_FLAGS), f"{path.name}: {flag} matches no option"
            else:
                assert flag in known, (
                    f"{path.name} names {flag}, which is no option of kvdepotd, the kvdepot CLI or a bench "
                    "script (a program of someone else's goes in FOREIGN_FLAGS)"
                )


def _daemon_command_lines(text: str) -> list[str]:
    spans = re.findall(r"`([^`\n]+)`", text) + text.splitlines()
    return [s for s in spans if re.match(r"\s*(\S*/)?kvdepotd\s", s) or "-m kvdepot.server " in s
            or "make run ARGS=" in s]


def test_daemon_command_lines_in_the_docs_take_only_daemon_flags():
    for path in DOCS:
        for line in _daemon_command_lines(path.read_text()):
            command = line.split("make run ARGS=", 1)[-1]
            unknown = _flags_in(command) - DAEMON_FLAGS
            assert not unknown, f"{path.name}: `{line.strip()}` gives kvdepotd {sorted(unknown)}, which it has not"


VALUE = r"[0-9][0-9.]*\s*[A-Za-z]*|[a-z][a-z0-9.:]*"


def stated_defaults(text: str) -> list[tuple[str, str, str]]:
    """(flag, value, where) for each default a doc states: a table row that
    begins with a flag and then its default, `(--flag, VALUE)` in prose, and
    `--flag VALUE` under a heading about defaults."""
    found = []
    heading = ""
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("#"):
            heading = line
        row = re.match(r"\| `(--[a-z0-9-]+)` \|(?: `KVDEPOT_[A-Z_]+` \|)? `([^`]+)`", line)
        if row:
            found.append((row.group(1), row.group(2), f"line {number}"))
        for flag, value in re.findall(rf"\(`(--[a-z0-9-]+)`, ({VALUE})\)", line):
            found.append((flag, value, f"line {number}"))
        if "default" in heading.lower():
            for flag, value in re.findall(rf"`(--[a-z0-9-]+) ({VALUE})`", line):
                found.append((flag, value, f"line {number}"))
    return [(flag, value, where) for flag, value, where in found if flag in DAEMON_FLAGS and flag != "--help"]


def same_value(opt, stated: str) -> bool:
    default = opt.default
    try:
        if opt.size:
            return parse_size(stated) == parse_size(default)
        if opt.kind in (int, float):
            return float(stated) == float(default)
    except (ConfigError, ValueError):
        return False
    return stated == str(default)


def test_defaults_the_docs_state_are_the_options_defaults():
    by_flag = {opt.flag: opt for opt in OPTIONS}
    checked = 0
    for path in DOCS:
        for flag, value, where in stated_defaults(path.read_text()):
            opt = by_flag[flag]
            if opt.shown_default is not None or opt.default is None:
                continue
            checked += 1
            assert same_value(opt, value), (
                f"{path.name} {where} says {flag} defaults to {value}; server/daemon/options.py says "
                f"{opt.default_text()}"
            )
    assert checked > len(OPTIONS), "the docs state fewer defaults than the option table has: the patterns broke"


@pytest.mark.parametrize("text, flag, value", [
    ("- **Staging buffers** (`--staging-bytes`, 256 MiB): with 4 GiB jobs", "--staging-bytes", "256 MiB"),
    ("| `--max-job-connections` | `2048` | Job socket connections", "--max-job-connections", "2048"),
    ("### Measurements behind the defaults\n- **Programs** (`--copy-programs 2`): over", "--copy-programs", "2"),
])  # fmt: skip
def test_a_wrong_default_in_the_docs_is_caught(text, flag, value):
    [(found_flag, found_value, _)] = stated_defaults(text)
    assert (found_flag, found_value) == (flag, value)
    assert not same_value(BY_KEY[flag[2:].replace("-", "_")], value)
