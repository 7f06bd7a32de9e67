"""Scrape cost: ``/metrics`` time and size with N ranks x 2 optimizers, collector vs Pushgateway.

The collector is filled with N ranks (three protocol v1 batches each); then the Pushgateway is given
exactly the series that collector exposed, in groups of up to 64 ranks (filling it one group per rank
costs O(N^2) there). ``/metrics`` is then fetched several times uncompressed, then as many times as
Prometheus asks for it (``Accept-Encoding: gzip``). Also resident memory per rank of each.

    python -m bench.scrape [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import urllib.request

from bench import _servers
from bench._loadgen_bodies import ampwatch_template

__all__ = ["LEVELS", "fill", "run", "main"]

LEVELS = (1, 64, 1024, 4096)
GROUP = 64  # ranks per Pushgateway group when filling it


def _post(port: int, method: str, path: str, body: bytes, content_type: str) -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method=method,
                                     headers={"Content-Type": content_type})
    with urllib.request.urlopen(request, timeout=120) as answer:
        return answer.status


def pushgateway_groups(exposition: str, group: int = GROUP) -> dict[str, bytes]:
    """Split the collector's exposition into Pushgateway group bodies of up to ``group`` ranks each."""
    families: list[tuple[str, list[str]]] = []  # (TYPE/HELP lines, samples) in order
    bodies: dict[str, dict[int, list[str]]] = {}
    meta: list[str] = []
    for line in exposition.splitlines():
        if not line:
            continue
        if line.startswith("#"):
            meta.append(line)
            continue
        if meta:
            families.append(("\n".join(meta), []))
            meta = []
        families[-1][1].append(line)
    for index, (_, samples) in enumerate(families):
        for sample in samples:
            if 'rank="' in sample:
                name = str(int(sample.split('rank="', 1)[1].split('"', 1)[0]) // group)
            else:
                name = "run"  # run aggregates and the collector's own metrics
            bodies.setdefault(name, {}).setdefault(index, []).append(sample)
    out = {}
    for name, by_family in bodies.items():
        text = []
        for index, samples in by_family.items():
            text.append(families[index][0])
            text.extend(samples)
        out[name] = ("\n".join(text) + "\n").encode()
    return out


async def _fill_collector(port: int, run: str, ranks: int, connections: int = 16) -> None:
    async def worker(first: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for rank in range(first, ranks, connections):
                build = ampwatch_template(run, rank, ranks)
                for seq in (1, 2, 3):  # three updates: counters moved, as on a live rank
                    body = build(seq)
                    writer.write(b"POST /v1/ingest HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                    status = int((await reader.readline()).split(b" ")[1])
                    length = 0
                    while (line := await reader.readline()) not in (b"\r\n", b""):
                        if line[:15].lower() == b"content-length:":
                            length = int(line[15:])
                    await reader.readexactly(length)
                    if status != 200:
                        raise RuntimeError(f"collector answered {status} while filling")
        finally:
            writer.close()
    await asyncio.gather(*(worker(c) for c in range(min(connections, ranks))))


def fill(srv: _servers.Server, ranks: int, exposition: str = "") -> None:
    """Give ``srv`` the state of ``ranks`` ranks x 2 optimizers (the Pushgateway: ``exposition``'s series)."""
    if srv.kind == "ampwatch":
        asyncio.run(_fill_collector(srv.port, f"scrape-{ranks}", ranks))
        return
    for name, body in pushgateway_groups(exposition).items():
        _post(srv.port, "PUT", f"/metrics/job/scrape-{ranks}/group/{name}", body, "text/plain; version=0.0.4")


def _scrape(url: str, times: int, encoding: str = "identity") -> tuple[list[float], bytes]:
    out, body = [], b""
    for _ in range(times):
        t = time.perf_counter()
        with urllib.request.urlopen(urllib.request.Request(url + "/metrics", headers={"Accept-Encoding": encoding}),
                                    timeout=120) as answer:
            body = answer.read()
        out.append((time.perf_counter() - t) * 1000)
    return out, body


def level(kind: str, ranks: int, scrapes: int, exposition: str = "") -> tuple[dict, str]:
    """Fill a fresh server with ``ranks`` ranks and time its scrapes; add its memory; return its exposition too."""
    with _servers.server(kind) as srv:
        rss0 = srv.stats.memory_kib()["VmRSS"]
        t = time.perf_counter()
        fill(srv, ranks, exposition)
        fill_s = time.perf_counter() - t
        _scrape(srv.url, 1)  # warm-up
        times, body = _scrape(srv.url, scrapes)
        gzip_times, gzipped = _scrape(srv.url, scrapes, "gzip")  # as Prometheus asks (the Pushgateway may not)
        rss = srv.stats.memory_kib()["VmRSS"]
        samples = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
        return {"target": kind, "ranks": ranks, "scrape_median_ms": round(statistics.median(times), 2),
                "scrape_min_ms": round(min(times), 2), "scrape_max_ms": round(max(times), 2),
                "bytes": len(body), "samples": samples, "gzip_bytes": len(gzipped),
                "gzip_scrape_median_ms": round(statistics.median(gzip_times), 2), "fill_s": round(fill_s, 2),
                "rss_kib_before": rss0, "rss_kib_after": rss,
                "rss_kib_per_rank": round((rss - rss0) / ranks, 2) if ranks >= 64 else None}, body.decode()


def run(levels: tuple[int, ...] = LEVELS, scrapes: int = 7, peer: bool = True) -> dict:
    """Measure every level on both servers; return the results."""
    out = []
    for ranks in levels:
        result, exposition = level("ampwatch", ranks, scrapes)
        out.append(result)
        if peer:  # the Pushgateway holds exactly the series the collector exposed
            out.append(level("pushgateway", ranks, scrapes, exposition)[0])
    return {"levels": out, "scrapes": scrapes, "pushgateway_group_size": GROUP}


def main(argv: list[str] | None = None) -> int:
    """Run and print the results as JSON."""
    parser = argparse.ArgumentParser(prog="python -m bench.scrape", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 and 1,024 ranks, 3 scrapes each")
    args = parser.parse_args(argv)
    print(json.dumps(run((1, 1024) if args.quick else LEVELS, 3 if args.quick else 7), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
