"""Command line: ``python -m xstage_lab {characterize,calibrate,visibility,import-bench,
measure-all,reproduce,summary}``."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .launch import BENCHMARKS, measurement_names
from .records import RECORDS_DIR


def _characterize(args) -> int:
    from .experiments.remote_store import CALIBRATION_SWEEPS, run_characterization

    if args.calibrate and args.only and not set(CALIBRATION_SWEEPS) <= set(args.only):
        raise SystemExit(f"--calibrate needs the sweeps {CALIBRATION_SWEEPS} among --only")

    path = run_characterization(repeats=args.repeats, src=args.src, dst=args.dst,
                                only=tuple(args.only) if args.only else None, root=args.root)
    print(f"wrote {path}")
    if args.calibrate:
        from .experiments.remote_store import write_calibration
        print(f"wrote {write_calibration(path, root=args.root)}")
    return 0


def _characterize_beyond(args) -> int:
    import time
    import traceback

    from .experiments.injection_patterns import run_patterns
    from .experiments.remote_ops import run_operations

    repeats = {} if args.repeats is None else {"repeats": args.repeats}
    parts = {"patterns": lambda: run_patterns(root=args.root, **repeats),
             "ops": lambda: run_operations(src=args.src, dst=args.dst, root=args.root, **repeats)}
    t0, failed = time.monotonic(), []
    for name in args.only:
        try:  # each part its own record: one failing leaves the other's
            print(f"wrote {parts[name]()}", flush=True)
        except Exception:
            traceback.print_exc()
            failed.append(name)
    print(f"characterize-beyond: {time.monotonic() - t0:.0f} s"
          + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


def _calibrate(args) -> int:
    from .experiments.remote_store import write_calibration

    print(f"wrote {write_calibration(args.record, root=args.root)}")
    return 0


def _import_bench(args) -> int:
    from .records import import_bench_json

    print(f"wrote {import_bench_json(args.file, args.experiment, root=args.root)}")
    return 0


def _visibility(args) -> int:
    from .experiments.visibility import run_visibility

    print(f"wrote {run_visibility(src=args.src, dst=args.dst, repeats=args.repeats, root=args.root)}")
    return 0


def _measure_all(args) -> int:
    from .launch import measure_all

    for path in measure_all(root=args.root, only=args.only):
        print(f"wrote {path}")
    return 0


def _reproduce(args) -> int:
    from .runner import reproduce

    return reproduce(only=args.only, backend=args.backend, out=args.out)


def _summary(args) -> int:
    from .summary import summary

    s = summary(root=args.root)
    print(json.dumps(s, indent=2) if args.json else _format_summary(s))
    return 0


def _format_summary(s: dict) -> str:
    lines = []
    for platform, entries in s["platforms"].items():
        lines.append(platform)
        for key, value in entries.items():
            lines.append(f"  {key}: {json.dumps(value)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xstage_lab")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("characterize", help="run the remote-store sweeps (Fig. 3) on this machine")
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--src", type=int, default=0)
    p.add_argument("--dst", type=int, default=1)
    p.add_argument("--only", nargs="*", help="sweep names (drain_rate gap isolated lines pairs)")
    p.add_argument("--root", type=Path, default=RECORDS_DIR, help="records root")
    p.add_argument("--calibrate", action="store_true", help="also write the calibration record")
    p.set_defaults(func=_characterize)

    p = sub.add_parser("characterize-beyond",
                       help="injection patterns and remote operations (issue 6)")
    p.add_argument("--only", nargs="+", choices=("patterns", "ops"), default=["patterns", "ops"])
    p.add_argument("--repeats", type=int, default=None,
                   help="per point (default: 5; the patterns on more than four GPUs: 3)")
    p.add_argument("--src", type=int, default=0, help="source GPU of the operations")
    p.add_argument("--dst", type=int, default=1, help="destination GPU of the operations")
    p.add_argument("--root", type=Path, default=RECORDS_DIR, help="records root")
    p.set_defaults(func=_characterize_beyond)

    p = sub.add_parser("calibrate", help="fit M_X from a remote_store record into a calibration record")
    p.add_argument("record", type=Path, help="path of a remote_store record")
    p.add_argument("--root", type=Path, default=RECORDS_DIR)
    p.set_defaults(func=_calibrate)

    p = sub.add_parser("import-bench", help="save a benchmark's JSON output as a record (a "
                                            "torchrun benchmark's, or fa_tuning: "
                                            "attention_bench --fa-only)")
    p.add_argument("file", type=Path)
    p.add_argument("--experiment", required=True, choices=sorted(BENCHMARKS) + ["fa_tuning"])
    p.add_argument("--root", type=Path, default=RECORDS_DIR)
    p.set_defaults(func=_import_bench)

    p = sub.add_parser("visibility", help="receiver-side remote-visible completion latency "
                       "(issue 8 part 2), with the two GPUs' clocks aligned by ping-pong")
    p.add_argument("--src", type=int, default=0)
    p.add_argument("--dst", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--root", type=Path, default=RECORDS_DIR, help="records root")
    p.set_defaults(func=_visibility)

    p = sub.add_parser("measure-all", help="every experiment live on this machine, as records")
    p.add_argument("--root", type=Path, default=RECORDS_DIR)
    p.add_argument("--only", nargs="+", choices=measurement_names(),
                   help="these measurements only, in this order (default: all)")
    p.set_defaults(func=_measure_all)

    p = sub.add_parser("reproduce", help="run every notebook headlessly (papermill)")
    p.add_argument("--only", action="append", help="notebook name (repeatable)")
    p.add_argument("--backend", choices=("auto", "cuda", "replay"), default="auto")
    p.add_argument("--out", type=Path, default=Path("out"))
    p.set_defaults(func=_reproduce)

    p = sub.add_parser("summary", help="headline numbers of the committed records")
    p.add_argument("--json", action="store_true")
    p.add_argument("--root", type=Path, default=RECORDS_DIR)
    p.set_defaults(func=_summary)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
