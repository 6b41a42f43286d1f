"""Report a settings sweep: one study folder per setting (docs/study.md, the learning-rate sweep).

    python examples/sweep_report.py outputs/study_gpu_chain/lr* --out docs/study/chain-gpu-lr

writes ``chain-gpu-lr.json`` (per-run figures), ``.md`` (a table) and ``.png`` (smoothed training reward
per step beside held-out accuracy before and after GRPO) from the finished runs in those folders,
and prints the table. Every number comes from the runs' own files.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", help="study output folders, one per setting")
    parser.add_argument("--out", required=True, help="path of the report without suffix (.json, .md, .png)")
    parser.add_argument("--window", type=int, default=30, help="steps averaged for the first / last reward")
    args = parser.parse_args(argv)
    from jetrl_trainer.study.sweep import sweep_report

    try:
        sweep_report(args.folders, args.out, window=args.window)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    print(open(f"{args.out}.md").read())
    print(f"wrote {args.out}.json, .md and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
