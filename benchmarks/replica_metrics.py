"""Sum Prometheus samples over every ingress replica behind one port.

The replicas of a node share the port, so one scrape reaches one of them (its name in
`x-pdserve-ingress`): this scrapes on fresh connections until it has seen `--replicas`
different ones (or gives up after `--tries`) and prints, as JSON, each named sample summed over
them and the replicas seen.

    python benchmarks/replica_metrics.py --url http://127.0.0.1:8000 --replicas 2 \
        pdserve_engine_time_to_first_output_seconds_sum pdserve_engine_time_to_first_output_seconds_count
"""

from __future__ import annotations

import argparse
import json
import urllib.request


def sample_sum(text: str, name: str) -> float:
    """The sum of every sample of `name` (any labels) in Prometheus text."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rpartition(" ")[2])
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--tries", type=int, default=200)
    p.add_argument("names", nargs="+")
    args = p.parse_args()
    bodies: dict[str, str] = {}
    for _ in range(args.tries):
        with urllib.request.urlopen(f"{args.url}/metrics", timeout=10) as response:
            name = response.headers.get("x-pdserve-ingress", "in-process")
            bodies.setdefault(name, response.read().decode())
        if len(bodies) >= args.replicas:
            break
    print(json.dumps({"replicas_seen": sorted(bodies),
                      **{n: sum(sample_sum(b, n) for b in bodies.values()) for n in args.names}}))


if __name__ == "__main__":
    main()
