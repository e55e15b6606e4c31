"""The docs' option tables, made from server/daemon/options.py's OPTIONS.

    python -m kvdepot.server.daemon.options_doc --write   # rewrites the docs' marked tables
    python -m kvdepot.server.daemon.options_doc --markdown  # prints the table
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from kvdepot.server.daemon.options import GROUPS, OPTIONS

BEGIN_MARK = (
    "<!-- BEGIN OPTIONS TABLE: generated from server/daemon/options.py by scripts/gen-options-doc; do not edit -->"
)
END_MARK = "<!-- END OPTIONS TABLE -->"
DOCS = ("README.md", "docs/*.md")


def markdown() -> str:
    """The option tables, a group each, in Markdown."""
    lines: list[str] = []
    for group, title in GROUPS.items():
        lines += [""] if lines else []
        lines += [f"**{title}**", "", "| option | environment | default | what it does |", "| --- | --- | --- | --- |"]
        for opt in (o for o in OPTIONS if o.group == group):
            env = f"`{opt.env}`" if opt.env else ""
            default = opt.shown_default if opt.shown_default is not None else f"`{opt.default_text()}`"
            lines.append(f"| `{opt.flag}` | {env} | {default} | {_cell(opt.help)} |")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def rewrite(text: str, table: str) -> str:
    """`text` with what stands between each pair of markers replaced by `table`."""
    pattern = re.compile(re.escape(BEGIN_MARK) + r"\n.*?" + re.escape(END_MARK), re.S)
    return pattern.sub(lambda _: f"{BEGIN_MARK}\n{table}{END_MARK}", text)


def marked_files(root: Path) -> list[Path]:
    files = [path for pattern in DOCS for path in sorted(root.glob(pattern))]
    return [path for path in files if BEGIN_MARK in path.read_text()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kvdepotd's option tables, made from OPTIONS.")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--markdown", action="store_true", help="print the tables")
    what.add_argument("--write", metavar="CHECKOUT", nargs="?", const=".",
                      help="rewrite the marked tables of CHECKOUT's README.md and docs/*.md (default: .)")
    args = parser.parse_args(argv)
    table = markdown()
    if args.markdown:
        sys.stdout.write(table)
        return 0
    root = Path(args.write)
    files = marked_files(root)
    if not files:
        print(f"no file of {', '.join(DOCS)} under {root} has the marker {BEGIN_MARK}", file=sys.stderr)
        return 1
    for path in files:
        text = path.read_text()
        new = rewrite(text, table)
        if new != text:
            path.write_text(new)
            print(f"rewrote the option table of {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
