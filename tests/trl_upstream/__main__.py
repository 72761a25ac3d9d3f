"""``python -m tests.trl_upstream --trl-tests <TRL>/tests --out <folder> [test files]``: see the package."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from . import compare, standins

FILES = ["test_sft_trainer.py", "test_dpo_trainer.py", "test_reward_trainer.py", "test_grpo_trainer.py"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.trl_upstream", description=__doc__)
    parser.add_argument("--trl-tests", type=Path, required=True, help="TRL's tests folder (a checkout's tests/)")
    parser.add_argument("--out", type=Path, required=True, help="where the stand-ins, both runs and the table go")
    parser.add_argument("files", nargs="*", default=FILES, help=f"TRL's test files to run (default: {FILES})")
    parser.add_argument("--workers", type=int, default=0, help="pytest-xdist processes per side (0: none)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds one test may take")
    parser.add_argument("-k", dest="select", help="pytest's -k, on both sides")
    parser.add_argument(
        "--sides",
        nargs="*",
        choices=compare.SIDES,
        default=list(compare.SIDES),
        help="run these sides only (none: the table only); the others' last reports in --out are reused",
    )
    args = parser.parse_args(argv)
    missing = [name for name in args.files if not (args.trl_tests / name).is_file()]
    if missing:
        parser.error(f"not in {args.trl_tests}: {', '.join(missing)}")
    out = args.out.resolve()
    environment = standins.build(out / "standins")
    compare.run_sides(out, args.trl_tests.resolve(), args.files, environment, sides=args.sides, workers=args.workers,
                      timeout=args.timeout, select=args.select)  # fmt: skip
    results = {}
    for side in compare.SIDES:
        junit = out / side / "junit.xml"
        if not junit.is_file():
            parser.error(f"{side}: no report at {junit} (see {out / side / 'pytest.log'})")
        results[side] = compare.outcomes(junit)
    rows, counts, regressions = compare.table(results)
    summary = ["| file | " + " | ".join(compare.CATEGORIES) + " |", "|---|" + "---|" * len(compare.CATEGORIES)]
    summary += [f"| {name} | " + " | ".join(str(c[k]) for k in compare.CATEGORIES) + " |" for name, c in counts.items()]
    listed = "".join(f"- `{test_id}`\n" for test_id in regressions) or "none\n"
    adapted = (out / "trl" / "adapted.txt").read_text(encoding="utf-8") or "none\n"
    report = "\n".join(summary) + f"\n\n## Pass with TRL, fail with hflight.trl\n\n{listed}\n"
    report += f"## Imported from TRL, not in the installed TRL (stand-ins raise when used)\n\n{adapted}\n"
    report += f"## Every test\n\n{rows}"
    (out / "results.md").write_text(report, encoding="utf-8")
    (out / "results.json").write_text(json.dumps({"counts": counts, "pass_only_with_trl": regressions,
                                                  "outcomes": results}, indent=1), encoding="utf-8")  # fmt: skip
    print("\n".join(summary))
    print(f"pass with TRL, fail with hflight.trl: {len(regressions)}" + "".join(f"\n  {t}" for t in regressions))
    print(f"table: {out / 'results.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
