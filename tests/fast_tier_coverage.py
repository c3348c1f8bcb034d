"""Which modules of src/replayrl the fast tier runs, from the data `make test-fast-coverage`
collects (coverage.py, subprocesses and xdist workers included): the lines each module ran,
its least-covered modules, and an exit status of 1 when a module ran no line at all.

Importing a module runs its top-level lines, so 0 lines means nothing imported it; a low
percentage says the fast tier imports it but exercises little of it."""

from __future__ import annotations

import sys
from pathlib import Path

import coverage

SRC = Path(__file__).resolve().parents[1] / "src" / "replayrl"


def main() -> int:
    cov = coverage.Coverage()
    cov.load()
    rows = []
    for path in sorted(SRC.rglob("*.py")):
        _, statements, _, missing, _ = cov.analysis2(str(path))
        if statements:
            ran = len(statements) - len(missing)
            rows.append((ran / len(statements), ran, len(statements), path.relative_to(SRC)))
    rows.sort()
    print("least covered modules of src/replayrl by the fast tier:")
    for share, ran, total, name in rows[:15]:
        print(f"  {share:6.1%}  {ran:5d}/{total:<5d} {name}")
    none = [str(name) for share, ran, _, name in rows if ran == 0]
    print(
        f"{len(rows)} modules; {len(none)} ran no line" + (f": {', '.join(none)}" if none else "")
    )
    return 1 if none else 0


if __name__ == "__main__":
    sys.exit(main())
