"""Lines of code per workspace package, against its budget: a table, and a non-zero exit when a package with a
budget is over it.

    python3 scripts/line_budget.py

Counted: each package's ``src/`` Python, blank lines and comment-only lines left out (docstrings count: they are the
documented contract). Core's budget is written in CONTRIBUTING.md ("core's line budget: N lines") and read from
there; a package without a budget is only printed.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGET = re.compile(r"(\S+)'s line budget: ([\d,]+) lines")


def lines(folder: Path) -> int:
    total = 0
    for path in sorted((folder / "src").rglob("*.py")):
        total += sum(1 for line in path.read_text().splitlines() if line.strip() and not line.strip().startswith("#"))
    return total


def budgets() -> dict[str, int]:
    text = (ROOT / "CONTRIBUTING.md").read_text()
    return {name: int(n.replace(",", "")) for name, n in BUDGET.findall(text)}


def main() -> int:
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    limits, over = budgets(), []
    print(f"{'package':<24}{'lines':>8}{'budget':>9}")
    for member in root["tool"]["uv"]["workspace"]["members"]:
        count, limit = lines(ROOT / member), limits.get(member)
        print(f"{member:<24}{count:>8}{limit if limit is not None else '':>9}")
        if limit is not None and count > limit:
            over.append(f"{member}: {count} lines, budget {limit}")
    if over:
        print("over budget (make room or argue for more in CONTRIBUTING.md): " + "; ".join(over))
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
