"""Run bench modules and write their tables as one Markdown section: python -m bench.report
OUT.md bench_norm bench_rope ..."""

from __future__ import annotations

import datetime
import importlib
import sys
import traceback

from bench.common import header


def main(path: str, names: list[str]) -> None:
    parts = [f"## {datetime.date.today()}: {', '.join(names)}\n", header() + "\n"]
    for name in names:
        print(f"== {name}", flush=True)
        try:
            parts.append(importlib.import_module(f"bench.{name}").main().markdown())
        except Exception:  # noqa: BLE001 - one failing bench must not hide the others
            parts.append(f"### {name}\n\nfailed:\n```\n{traceback.format_exc()}```\n")
            traceback.print_exc()
    with open(path, "w") as f:
        f.write("\n".join(parts))
    print("\n".join(parts))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
