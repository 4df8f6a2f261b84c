"""The docs a reader finishes: the README is short, nothing points outside the repository, every
relative link lands on a file (and heading), every module or path the docs name exists, and
every default the docs quote is the command line's own.

The defaults come from the parsers themselves (``duplex session``: ``session_service.api.cli``,
``duplex worker``: ``worker_service.cli``), never from a copy: a flag renamed or a default
changed in the code fails here until ``docs/operations.md`` says the same.
"""

from __future__ import annotations

import argparse
import importlib
import re
import unicodedata
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
OPERATIONS = DOCS / "operations.md"

README_MAX_BYTES = 12 * 1024
# Built, so that this file does not hold what it looks for.
OUTSIDE_REFERENCES = ("../" + "shared", "shared/" + "DESIGN")
# Directories that are not the project's own files.
SKIP_DIRS = {".git", ".venv", "venv", "node_modules", "__pycache__", "build", "dist"}
SCANNED_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".cfg", ".txt", ".sh"}
# What `make bench` and `make demo` write into a checkout; the docs name them, nothing commits them.
GENERATED = {
    "BENCHMARKS.md",
    "benchmarks/latest.json",
    "benchmarks/notes.md",
    "benchmarks/plots",
    "benchmarks/gpu",
    "examples/hello.reply.wav",
    "examples/coffee.reply.wav",
}
# The repository's own top-level packages and folders a doc may name.
OWN_PACKAGES = (
    "duplex",
    "session_service",
    "worker_service",
    "realtime_service",
    "benchmarks",
    "tests",
    "deploy",
)
OWN_FOLDERS = (*OWN_PACKAGES, "proto", "examples", "docs")


# "`--flag` (default 10 s" or "`--flag`, default 3 s": the flag, the number, its unit if any.
QUOTED_DEFAULT = re.compile(r"`(--[a-z0-9-]+)`(?: \(|, )default (-?\d+(?:\.\d+)?)(?: ?(ms|s|min|h)\b)?")


# ---- helpers -----------------------------------------------------------------------------------


def _markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md")), REPO / "deploy" / "README.md"]


def _project_files() -> Iterator[Path]:
    for path in REPO.rglob("*"):
        rel = path.relative_to(REPO)
        if any(part in SKIP_DIRS or part.endswith(".egg-info") or part.startswith(".") for part in rel.parts):
            continue
        if path.is_file() and (path.suffix in SCANNED_SUFFIXES or path.name == "Makefile"):
            yield path


def _prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return re.sub(r"^```.*?^```[^\n]*$", "", text, flags=re.S | re.M)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    kept = "".join(ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in "LN")
    return kept.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    slugs: set[str] = set()
    for line in _prose(path.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = _slug(m.group(1))
        slug, n = base, 0
        while slug in slugs:
            n += 1
            slug = f"{base}-{n}"
        slugs.add(slug)
    return slugs


def _links(path: Path) -> Iterator[tuple[str, str]]:
    """(target, anchor) of every relative markdown link in ``path``, outside code blocks."""
    for m in re.finditer(r"\[[^\]]*\]\(([^)\s]+)\)", _prose(path.read_text(encoding="utf-8"))):
        target = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        yield file_part, anchor


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """``duplex <command>`` -> its argparse parser, built by the command's own module."""
    session_cli = importlib.import_module("session_service.api.cli")
    worker_cli = importlib.import_module("worker_service.cli")
    realtime_cli = importlib.import_module("realtime_service.cli")
    session_build = getattr(session_cli, "build_parser", None) or session_cli._parser
    return {
        "session": session_build(),
        "worker": worker_cli.build_parser(),
        "realtime": realtime_cli.build_parser(),
    }


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag: action for flag, action in parser._option_string_actions.items() if flag.startswith("--")}


def _flag_tables(text: str) -> dict[str, list[tuple[list[str], str]]]:
    """``### `duplex X` `` sections of operations.md -> the rows (flags, default cell) of their
    ``flag | default | meaning`` table."""
    tables: dict[str, list[tuple[list[str], str]]] = {}
    command = None
    for line in text.splitlines():
        heading = re.match(r"^###\s+`duplex (\w+)`\s*$", line)
        if heading:
            command = heading.group(1)
            tables[command] = []
            continue
        if line.startswith("#"):
            command = None
            continue
        if command is None or not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or cells[0] == "flag" or set(cells[0]) <= set("-: "):
            continue
        flags = re.findall(r"`(--[a-z0-9-]+)`", cells[0])
        assert flags, f"a row of `duplex {command}`'s table names no flag: {line!r}"
        tables[command].append((flags, cells[1]))
    return tables


def _matches(action: argparse.Action, cell: str) -> bool:
    default = action.default
    if cell == "required":
        return bool(action.required)
    if action.required:
        return False
    if cell == "off":
        return isinstance(action, argparse._StoreTrueAction) and default is False
    if cell == "none":
        return default is None or default == "" or default == []  # [] : a flag given again and again
    literal = re.fullmatch(r"`([^`]*)`", cell)
    if literal is None:
        return False
    value = literal.group(1)
    if isinstance(default, bool) or default is None:
        return False
    if isinstance(default, int | float):
        try:
            number = float(value)
        except ValueError:
            return False
        if isinstance(default, int) and not re.fullmatch(r"-?\d+", value):
            return False
        return number == float(default)
    return str(default) == value


def _in_flag_unit(flag: str, value: str, unit: str | None) -> str:
    """A quoted "24 h" of a ``-s`` flag is ``86400``; a flag's own unit, or none, is the value."""
    seconds = {"h": 3600.0, "min": 60.0, "s": 1.0, "ms": 0.001}
    if unit is None or flag.endswith(f"-{unit}"):
        return value
    own = "ms" if flag.endswith("-ms") else "s" if flag.endswith("-s") else None
    if own is None:
        return value
    scaled = float(value) * seconds[unit] / seconds[own]
    return str(int(scaled)) if scaled.is_integer() else str(scaled)


# ---- tests -------------------------------------------------------------------------------------


def test_readme_is_short() -> None:
    size = README.stat().st_size
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; at most {README_MAX_BYTES}"


def test_nothing_points_outside_the_repository() -> None:
    offenders = []
    for path in _project_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for needle in OUTSIDE_REFERENCES:
            for lineno, line in enumerate(text.splitlines(), 1):
                if needle in line:
                    offenders.append(f"{path.relative_to(REPO)}:{lineno}: {line.strip()}")
    assert not offenders, "references outside the repository (use docs/design.md):\n" + "\n".join(offenders)


def test_design_is_in_the_repository() -> None:
    text = (DOCS / "design.md").read_text(encoding="utf-8")
    for part in ("## Fencing", "## Trust", "## Membership and placement", "## Failover", "## Operations"):
        assert part in text
    assert "docs/design.md" in README.read_text(encoding="utf-8")


@pytest.mark.parametrize("doc", _markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_land(doc: Path) -> None:
    broken = []
    for file_part, anchor in _links(doc):
        target = (doc.parent / file_part).resolve() if file_part else doc
        if not target.exists():
            broken.append(f"{file_part}: no such file")
            continue
        if anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(f"{file_part}#{anchor}: no such heading")
    assert not broken, f"{doc.relative_to(REPO)}: broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize("doc", _markdown_files()[:-1], ids=lambda p: str(p.relative_to(REPO)))
def test_named_modules_and_paths_exist(doc: Path) -> None:
    """Every `package.module` and `folder/file` the README or a page of docs/ names in backticks
    is in the tree (what `make bench` or `make demo` writes excepted). deploy/README.md is left
    out: its `duplex/...` are image names."""
    missing = []
    for token in set(re.findall(r"`([^`\s]+)`", doc.read_text(encoding="utf-8"))):
        name = token.split(":", 1)[0].rstrip(".,;")
        if "/" in name:
            if name.split("/", 1)[0] not in OWN_FOLDERS or name.startswith("../"):
                continue
            rel = name.rstrip("/")
            if rel in GENERATED or any(rel.startswith(g + "/") for g in GENERATED):
                continue
            if not (REPO / rel).exists() and not (REPO / "proto" / rel).exists():
                missing.append(token)
            continue
        parts = name.split(".")
        if parts[0] not in OWN_PACKAGES or len(parts) < 2 or not all(p.isidentifier() for p in parts):
            continue
        if parts[-1] in ("py", "md", "json"):
            continue
        where = REPO
        for part in parts:
            if (where / part).is_dir():
                where = where / part
                continue
            if (where / f"{part}.py").is_file():
                break  # a module: the rest are its attributes
            # A package's attribute (a class, a generated message) starts upper case; a lower-case
            # name that is neither a module nor a package is a module that is gone.
            if not part[0].isupper():
                missing.append(token)
            break
    assert not missing, f"{doc.relative_to(REPO)} names what is not in the tree: {sorted(missing)}"


def test_named_commands_exist() -> None:
    subcommands = importlib.import_module("duplex.cli").SUBCOMMANDS
    unknown = set()
    for doc in _markdown_files():
        text = doc.read_text(encoding="utf-8")
        named = re.findall(r"`duplex ([a-z][a-z-]*)", text)
        named += re.findall(r"^(?:\s*\$ )?(?:\S*/)?duplex ([a-z][a-z-]*)\b", text, flags=re.M)
        unknown |= {f"{doc.relative_to(REPO)}: duplex {n}" for n in named if n not in subcommands}
    assert not unknown, f"commands that `duplex` does not have: {sorted(unknown)}"


def test_flag_tables_quote_the_parsers_defaults() -> None:
    parsers = _parsers()
    tables = _flag_tables(OPERATIONS.read_text(encoding="utf-8"))
    assert set(tables) == set(parsers), f"operations.md has flag tables for {sorted(tables)}"
    problems = []
    for command, rows in tables.items():
        options = _options(parsers[command])
        assert len(rows) >= 20, f"`duplex {command}`'s table has only {len(rows)} rows"
        for flags, cell in rows:
            for flag in flags:
                action = options.get(flag)
                if action is None:
                    problems.append(f"duplex {command} {flag}: no such flag")
                elif not _matches(action, cell):
                    problems.append(
                        f"duplex {command} {flag}: the docs say {cell}, the parser "
                        f"{'requires it' if action.required else repr(action.default)}"
                    )
    assert not problems, "docs/operations.md disagrees with the command line:\n" + "\n".join(problems)


def test_defaults_quoted_in_prose_are_the_parsers() -> None:
    """Defaults quoted in prose, "`--flag` (default N" or "`--flag`, default N", in the README and
    docs/: N is that flag's default in one of the commands that has it ("24 h" read as seconds)."""
    parsers = _parsers()
    problems = []
    for doc in _markdown_files():
        text = re.sub(r"\s+", " ", _prose(doc.read_text(encoding="utf-8")))
        for m in QUOTED_DEFAULT.finditer(text):
            flag, value = m.group(1), _in_flag_unit(m.group(1), m.group(2), m.group(3))
            actions = [_options(p)[flag] for p in parsers.values() if flag in _options(p)]
            if not actions:
                problems.append(f"{doc.relative_to(REPO)}: {flag}: no such flag")
            elif not any(_matches(a, f"`{value}`") for a in actions):
                defaults = [a.default for a in actions]
                problems.append(f"{doc.relative_to(REPO)}: {flag} default {value}, the parser {defaults}")
    assert not problems, "\n".join(problems)


def test_operations_names_only_real_flags() -> None:
    """Every `--flag` the README or docs/operations.md names belongs to a `duplex` command."""
    known: set[str] = set()
    for parser in _parsers().values():
        known |= set(_options(parser))
    for module in ("duplex.stack", "duplex.talk", "duplex.demo"):
        known |= set(_options(importlib.import_module(module).build_parser()))
    unknown = set()
    for doc in (README, OPERATIONS):
        for flag in re.findall(r"`[^`]*?(--[a-z][a-z0-9-]+)", doc.read_text(encoding="utf-8")):
            if flag not in known:
                unknown.add(f"{doc.relative_to(REPO)}: {flag}")
    assert not unknown, f"flags no `duplex` command has: {sorted(unknown)}"


def test_parsers_table_helper_sees_a_mismatch() -> None:
    """The comparison itself: a wrong default, a wrong type of number and a made-up flag fail."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=3)
    parser.add_argument("--s", type=float, default=0.5)
    parser.add_argument("--name", default="auto")
    parser.add_argument("--flag", action="store_true")
    parser.add_argument("--path", default=None)
    opts = _options(parser)
    assert _matches(opts["--n"], "`3`") and not _matches(opts["--n"], "`4`")
    assert not _matches(opts["--n"], "`3.0`")
    assert _matches(opts["--s"], "`0.5`") and not _matches(opts["--s"], "none")
    assert _matches(opts["--name"], "`auto`") and not _matches(opts["--name"], "`asyncio`")
    assert _matches(opts["--flag"], "off") and not _matches(opts["--flag"], "none")
    assert _matches(opts["--path"], "none") and not _matches(opts["--path"], "`x`")
    assert _in_flag_unit("--ttl-s", "24", "h") == "86400"
    assert _in_flag_unit("--wait-ms", "2", "ms") == "2" and _in_flag_unit("--wait-s", "2", None) == "2"
    table = "### `duplex worker`\n\n| flag | default | meaning |\n|---|---|---|\n| `--n`, `--s` | `3` | x |\n"
    assert _flag_tables(table) == {"worker": [(["--n", "--s"], "`3`")]}
