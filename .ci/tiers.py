"""What the CI tiers ran, per test module, from their pytest JUnit reports (``xunit1``).

    python .ci/tiers.py skipped FAST.xml           # modules FAST.xml skipped whole, one a line
    python .ci/tiers.py check FAST.xml OTHER.xml   # every module ran somewhere (exit 1 if not)

A test module counts as run when at least one of its tests passed. ``skipped`` lists the
modules of a report whose every reported test was skipped (a module-level ``importorskip``
or one per test): the next tier, with more extras installed, runs them. ``check`` fails when
a report other than the first skipped a module whole (that tier was meant to run it), or when
a module of any report passed no test in any of them, naming the skip reasons.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def read_report(path: str) -> dict[str, dict[str, list[str]]]:
    """Per module file: the outcomes of its tests (``passed``, ``skipped``, ``failed``), each
    with the test names (skipped ones with their reason)."""
    modules: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("file")
        if not module:
            raise SystemExit(f"{path}: a testcase without a file attribute (run pytest with "
                             "-o junit_family=xunit1)")  # fmt: skip
        name = case.get("name", "")
        if (skip := case.find("skipped")) is not None:
            modules[module]["skipped"].append(f"{name}: {skip.get('message', '')}")
        elif case.find("failure") is not None or case.find("error") is not None:
            modules[module]["failed"].append(name)
        else:
            modules[module]["passed"].append(name)
    return modules


def skipped_whole(report: dict[str, dict[str, list[str]]]) -> list[str]:
    """The modules of a report that passed no test and failed none: all skipped."""
    return sorted(m for m, out in report.items() if not out["passed"] and not out["failed"])


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "skipped":
        print("\n".join(skipped_whole(read_report(argv[1]))))
        return 0
    if len(argv) >= 2 and argv[0] == "check":
        reports = {path: read_report(path) for path in argv[1:]}
        problems = []
        for path in argv[2:]:
            for module in skipped_whole(reports[path]):
                reasons = "; ".join(reports[path][module]["skipped"][:3])
                problems.append(f"{path}: the tier skipped all of {module} ({reasons})")
        every = sorted({m for report in reports.values() for m in report})
        for module in every:
            if not any(report.get(module, {}).get("passed") for report in reports.values()):
                skips = [
                    r for rep in reports.values() for r in rep.get(module, {}).get("skipped", [])
                ]
                reasons = "; ".join(skips)[:300]
                problems.append(f"{module}: no test passed in any tier ({reasons})")
        for line in problems:
            print(f"tiers: {line}", file=sys.stderr)
        if not problems:
            print(f"tiers: {len(every)} test modules, each ran in some tier")
        return 1 if problems else 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
