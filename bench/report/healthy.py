"""Section 4b: what a healthy run costs per rank by what its batches carry, today's beside issue 40's levels."""

from __future__ import annotations

__all__ = ["section", "summary_rows"]

_WHAT = {"today": "today's batch (counters, scale, delivery)",
         "levels": "+ the loss's level, each optimizer's gradient norm level and its local one (issue 40)",
         "levels_every_4th": "+ the same levels in one batch in 4 only, a minute apart on average: what the agent "
                             "sends (protocol.LEVEL_HEARTBEATS)"}


def _verdict(ratio: float, target: float) -> str:
    return "met" if ratio <= target else f"**not met** (+{100 * (ratio - 1):.1f}%)"


def _sides(res: dict, name: str) -> list[dict]:
    return [r["sides"][name] for r in res["rounds"]]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def section(res: dict) -> list[str]:
    target = res["target_ratio"]
    lines = ["| batch shape | bytes per exchange | wire KiB per rank-hour | x today | x today, answers listing kinds | "
             "collector CPU µs per rank-second | x today |", "|---|---|---|---|---|---|---|"]
    for name, sides in ((n, _sides(res, n)) for n in res["rounds"][0]["sides"]):
        ratio = res["ratios"].get(name)
        cells = ["-", "-", "-"] if sides[0].get("server") else ["1", "-", "1"] if ratio is None else [
            f"{ratio['wire_ratio']:.3f}", f"{ratio['wire_ratio_with_kinds']:.3f}", f"{ratio['cpu_ratio']:.3f}"]
        share = _mean([s.get("levelled_share", 0.0) for s in sides])
        what = ("today's batch on the collector of that commit (`--before`)" if sides[0].get("server")
                else _WHAT.get(name, name))
        what += f" ({100 * share:.1f}% of the batches measured)" if 0 < share < 1 else ""
        lines.append(f"| {name}: {what} | {_mean([s['bytes_per_exchange'] for s in sides]):,.0f} | "
                     f"{_mean([s['wire_kib_per_rank_hour'] for s in sides]):,.1f} | {cells[0]} | {cells[1]} | "
                     f"{_mean([s['collector_cpu_us_per_rank_s'] for s in sides]):.1f} | {cells[2]} |")
    lines += ["", f"Issue 40's target: at most x{target:.2f} of today's for each, in a healthy run:", ""]
    for name, ratio in res["ratios"].items():
        lines.append(f"- {name}: bytes {_verdict(ratio['wire_ratio'], target)}, with the answers' kinds "
                     f"{_verdict(ratio['wire_ratio_with_kinds'], target)}; collector CPU "
                     f"{_verdict(ratio['cpu_ratio'], target)}.")
    before = res.get("before")
    if before:
        lines += ["", f"Against today's batches on the collector of {before}, in the same run (what the whole change "
                  "costs, this tree's collector's own work included):", ""]
        for name, ratio in res["ratios_vs_before"].items():
            lines.append(f"- {name}: bytes x{ratio['wire_ratio']:.3f} (x{ratio['wire_ratio_with_kinds']:.3f} with the "
                         f"answers' kinds), {_verdict(ratio['wire_ratio_with_kinds'], target)}; collector CPU "
                         f"x{ratio['cpu_ratio']:.3f}, {_verdict(ratio['cpu_ratio'], target)}.")
    lines += _fixes(res)
    per_round = "; ".join(", ".join(f"{name} bytes x{r['wire_ratio']:.3f} CPU x{r['cpu_ratio']:.3f}"
                                    for name, r in m["ratios"].items()) for m in res["rounds"])
    first = res["rounds"][0]["sides"]["today"]
    lines += ["", f"Ratios are medians of {len(res['rounds'])} round(s) ({per_round}). Each round runs every shape at "
              f"once, each on a fresh collector of this tree with a simulated job of {res['ranks']:,} ranks "
              f"(`bench/experiments/_fleet_ranks.py`: the agent's push schedule, a heartbeat every "
              f"{first['heartbeat_s']:.0f} s, two optimizers, no skips; `bench._rank_batch.with_levels` gives the "
              f"levels, 4 significant digits as the agent sends them, no spike counter while 0), `/metrics` scraped "
              f"every 15 s; measured over {res['heartbeats']} heartbeats after every rank's first batch. Bytes: each "
              "request's line, headers and body and each answer with its headers. CPU: the collector process's user "
              "+ system time, every thread, from `/proc`. Load average (1 / 5 / 15 min) "
              f"{' / '.join(map(str, res['loadavg_start']))} at the start, "
              f"{' / '.join(map(str, res['loadavg_end']))} at the end.", "",
              f"*Answers listing kinds*: issue 40's collector lists the spike event kinds in every 2xx answer "
              f"(`\"kinds\"`, {res['kinds_bytes_per_answer']} bytes more); "
              + ("this tree's collector does not send it yet, so the column adds those bytes to each exchange of the "
                 "shape (a projection)." if not first["answer_lists_kinds"] else
                 "this tree's collector sends it, so the column takes those bytes off today's side (today's "
                 "collector sent none)."), "",
              "One healthy batch of each shape, exact (`bench.healthy.exchange_bytes`): the simulated ranks' request "
              "(line, headers, JSON body with spaces), the body as the agent encodes it (compact JSON), and the wire "
              "per rank-hour that the difference in the request makes over today's measured exchange (answer "
              "included, kinds not). The last rows are other ways to write the levels, in bytes only (a pair is not "
              "the contract's form: this tree's collector refuses it):", "",
              "| batch shape | request bytes (simulated) | body bytes (agent's encoding) | body x today | "
              "wire x today |", "|---|---|---|---|---|"]
    exchange = res["exchange"]
    today = exchange["today"]
    measured = _mean([s["bytes_per_exchange"] for s in _sides(res, "today")])
    for name, e in exchange.items():
        wire = (measured + e["request_bytes"] - today["request_bytes"]) / measured
        lines.append(f"| {name} | {e['request_bytes']:,.0f} | {e['agent_body_bytes']:,.0f} | "
                     f"{e['agent_body_bytes'] / today['agent_body_bytes']:.3f} | {wire:.3f} |")
    return lines


def _fixes(res: dict) -> list[str]:
    """What would bring the levels' bytes within the target, from this run's figures (nothing when they are)."""
    levels, target = res["ratios"].get("levels"), res["target_ratio"]
    if levels is None or max(levels["wire_ratio_with_kinds"], levels["cpu_ratio"]) <= target:
        return []
    exchange, today = res["exchange"], res["exchange"]["today"]["request_bytes"]
    measured = _mean([s["bytes_per_exchange"] for s in _sides(res, "today")])

    def wire(name: str) -> str:
        return f"x{(measured + exchange[name]['request_bytes'] - today) / measured:.3f}"

    lines = ["", f"What would bring them within x{target:.2f}: the added bytes are mostly names (`\"mean\"`, "
             f"`\"std\"`, the levels'), not digits: 3 significant digits instead of 4 give "
             f"{wire('levels, 3 significant digits')}, `[mean, std]` pairs {wire('levels, [mean, std] pairs')} (not "
             f"the contract's form: a contract change); the answers' kinds alone add "
             f"{100 * res['kinds_bytes_per_answer'] / measured:.1f}%."]
    every = res["ratios"].get("levels_every_4th")
    if every is not None:
        lines[-1] += (f" The levels in one batch in 4 (a minute apart at the default heartbeat) measured "
                      f"x{every['wire_ratio']:.3f}, x{every['wire_ratio_with_kinds']:.3f} with the answers' kinds: "
                      f"{'within' if every['wire_ratio_with_kinds'] <= target else 'still over'} the target: the "
                      "agent sends them so (one heartbeat in four, the first at once, and in its last batch), and "
                      "the collector keeps a process's last levels between batches that lack them.")
    return lines


def summary_rows(res: dict) -> list[str]:
    """The summary's row: a healthy run's bytes and collector CPU per rank with issue 40's levels, against today's."""
    ratio, target = res["ratios"]["levels"], res["target_ratio"]
    worst = max(ratio["wire_ratio_with_kinds"], ratio["cpu_ratio"])
    return [f"| healthy run with issue 40's levels, per rank | bytes x{ratio['wire_ratio']:.2f} "
            f"(x{ratio['wire_ratio_with_kinds']:.2f} with the answers' kinds), collector CPU x{ratio['cpu_ratio']:.2f} "
            f"| today's batches, same run | target x{target:.2f}: {'met' if worst <= target else '**not met**'} |"]
