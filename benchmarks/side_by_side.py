"""Sums up ``benchmarks/side_by_side.sh``: two checkouts' async_vs_sync and weight_sync
results, taken in alternation on one machine, side by side.

    python benchmarks/side_by_side.py OUT_DIR --json OUT_DIR/side_by_side.json

For each checkout (``base``, ``head``): every run's async/sync speedup and median step
times, and every weight-sync run's seconds and ratio to a raw broadcast of the same
bytes; then the medians, and head's over base's.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

AVS = ("speedup", "sync_step_s", "async_step_s", "acc_sync", "acc_async")
WS = ("seconds", "raw_broadcast_seconds", "ratio_vs_raw", "paired_ratio_vs_raw")


def runs(out: Path, bench: str, side: str, fields: tuple[str, ...]) -> list[dict]:
    return [{k: json.loads(p.read_text())[k] for k in fields}
            for p in sorted(out.glob(f"{bench}_{side}_*.json"))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the directory side_by_side.sh wrote")
    parser.add_argument("--json", type=Path, required=True, help="where to write the summary")
    args = parser.parse_args(argv)
    result: dict = {}
    for bench, fields in (("avs", AVS), ("ws", WS)):
        sides = {side: runs(args.out, bench, side, fields) for side in ("base", "head")}
        if not all(sides.values()):
            raise SystemExit(f"{args.out}: no {bench}_base_*.json or {bench}_head_*.json")
        medians = {side: {k: statistics.median(r[k] for r in rs) for k in fields} for side, rs in sides.items()}
        ratio = {k: medians["head"][k] / medians["base"][k] for k in fields if medians["base"][k]}
        result[bench] = {"runs": sides, "median": medians, "head_over_base": ratio}
        for k in fields:
            print(f"{bench} {k}: base {medians['base'][k]:.3f}, head {medians['head'][k]:.3f} "
                  f"(runs: base {[round(r[k], 3) for r in sides['base']]}, head {[round(r[k], 3) for r in sides['head']]})")
    args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
