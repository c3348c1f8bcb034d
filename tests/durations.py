"""The heaviest tests' call durations, for running them first: `make test` spreads the tests
over its pytest-xdist workers in collection order, so a test of several minutes collected
last runs alone on one worker while the others sit idle. `tests/conftest.py` moves the tests
named in `tests/durations.json` to the front, longest first (the rest keep their order).

Regenerate after adding or speeding up a long test (`make test-durations`, ~35 min): reads
the `--durations=0` report of a full `make test` on stdin, writes the tests whose call took at
least MIN_SECONDS.

    python tests/durations.py < full-run.log   # writes tests/durations.json
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

MIN_SECONDS = 20.0
OUT = Path(__file__).with_name("durations.json")
LINE = re.compile(r"^(\d+(?:\.\d+)?)s call\s+(\S+)\s*$")


def heaviest(lines) -> dict[str, float]:
    """{test id: call seconds} of the calls of at least MIN_SECONDS, longest first."""
    found = {}
    for line in lines:
        m = LINE.match(line.strip())
        if m and float(m.group(1)) >= MIN_SECONDS:
            found[m.group(2)] = round(float(m.group(1)), 1)
    return dict(sorted(found.items(), key=lambda kv: -kv[1]))


def main() -> int:
    found = heaviest(sys.stdin)
    if not found:
        print("no '<seconds>s call <test>' lines on stdin: pipe a --durations=0 report in")
        return 1
    OUT.write_text(json.dumps(found, indent=1) + "\n")
    print(f"wrote {OUT} ({len(found)} tests, {sum(found.values()):.0f} s of calls)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
