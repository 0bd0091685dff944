"""The docs site names what the tree holds: every module is on the layout page, every path there exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYOUT = ROOT / "docs" / "development" / "layout.md"
SOURCES = (".py", ".cpp", ".h")


def listed_paths() -> set[str]:
    """The paths in the layout page's tables, as repository paths (the package's are relative to radixserve/)."""
    paths = set()
    for cell in re.findall(r"^\| `([^`]+)` \|", LAYOUT.read_text(), re.M):
        if not cell.endswith(SOURCES):
            continue  # the table of what is around the package (Makefile, docs/, ...)
        top = cell.split("/")[0]
        paths.add(cell if top in ("benchmarks", "tests") else f"radixserve/{cell}")
    return paths


def tree_paths() -> set[str]:
    found = set()
    for folder in ("radixserve", "benchmarks", "tests/support"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in SOURCES and "__pycache__" not in path.parts:
                found.add(path.relative_to(ROOT).as_posix())
    return found


def test_the_layout_page_lists_every_module() -> None:
    assert sorted(tree_paths() - listed_paths()) == []


def test_every_module_on_the_layout_page_exists() -> None:
    assert sorted(listed_paths() - tree_paths()) == []


def test_every_server_flag_is_in_the_flag_reference() -> None:
    """``radixserve serve``'s flags (the parser's own option strings) each have a row in docs/server/flags.md."""
    from radixserve.server.args import build_parser

    reference = (ROOT / "docs" / "server" / "flags.md").read_text()
    flags = {
        option for action in build_parser()._actions for option in action.option_strings if option.startswith("--")
    }
    missing = sorted(flag for flag in flags - {"--help"} if not re.search(rf"`{re.escape(flag)}[` =]", reference))
    assert len(flags) > 40 and missing == []
