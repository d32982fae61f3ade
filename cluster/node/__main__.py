"""``python -m kiln_cluster.node --cluster DIR --node NAME``: run the node agent until SIGTERM."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from kiln_cluster.node.agent import Agent


def main() -> None:
    parser = argparse.ArgumentParser(prog="kiln_cluster.node")
    parser.add_argument("--cluster", type=Path, required=True, help="the cluster's folder (make cluster's)")
    parser.add_argument("--node", required=True, help="the Node's name")
    parser.add_argument("--cpu", default=str(8 * (os.cpu_count() or 1)),
                        help="the Node's allocatable CPU: pods are processes sharing the host, so requests are "
                             "bookkeeping; the default is 8 per core")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    agent = Agent(args.cluster.resolve(), args.node, args.cpu)

    def stop(*_: object) -> None:
        agent.shutdown()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    agent.run()


if __name__ == "__main__":
    main()
