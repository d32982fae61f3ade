"""``kiln-cluster up|down|status [--dir DIR]``: what ``make cluster`` / ``make cluster-down`` run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kiln_cluster import control_plane


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kiln-cluster")
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument("--dir", type=Path, default=Path(".kiln-work/cluster"),
                        help="the cluster's folder; bin/ must hold build.sh's binaries (default %(default)s)")
    parser.add_argument("--no-lws", action="store_true", help="do not start LeaderWorkerSet's controller")
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            control_plane.up(args.dir, lws=not args.no_lws)
        elif args.command == "down":
            control_plane.down(args.dir)
        else:
            c = control_plane.Cluster.load(args.dir.resolve())
            state = "running" if control_plane.running(c) else "not running"
            print(f"cluster: {state} ({args.dir})")
            return 0 if state == "running" else 1
    except RuntimeError as exc:
        print(f"cluster: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
