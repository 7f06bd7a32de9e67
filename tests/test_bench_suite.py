"""bench/ as a suite: ``python -m bench --list`` names what runs, every listed module imports, no import cycles.

Cheap by design: nothing is measured; the modules are imported and parsed, and ``--list`` runs in this process.
"""

from __future__ import annotations

import ast
import glob
import importlib
import importlib.util
import os

from bench import __main__ as bench_main
from bench import _catalogue

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")


def _modules() -> dict[str, str]:
    """Every module under bench/ by dotted name, with its path."""
    found = {}
    for folder, _, files in os.walk(BENCH):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


def _imports(module: str, path: str, known: set[str]) -> set[str]:
    """The bench modules ``module`` imports, at its top or inside a function (a cycle either way)."""
    out = set()
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            # ``from package import module`` needs that module (the package's __init__ is already under way)
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        out |= {name for name in names if name in known and name != module}
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle in ``graph`` as the modules along it, or [] when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return []

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return []


def test_list_names_every_section_make_bench_runs_with_what_it_measures_and_how_long(capsys):
    assert bench_main.main(["--list"]) == 0
    text = capsys.readouterr().out
    assert bench_main.SECTIONS == tuple(b.name for b in _catalogue.BENCHMARKS)
    for bench in _catalogue.BENCHMARKS:
        assert f"{bench.name:<13} python -m {bench.module}" in text
        assert bench.measures in text and f"full: {bench.full}" in text and f"--quick: {bench.quick}" in text
    for module, what in _catalogue.experiments():
        assert what, f"{module} has no docstring saying what it measures"
        assert f"  {module}\n" in text and what in text
    # Everything under bench/experiments/ that runs is listed.
    listed = {module for module, _ in _catalogue.experiments()}
    assert "bench.experiments.rule_eval" in listed
    on_disk = {f"bench.experiments.{n[:-3]}" for n in os.listdir(_catalogue.EXPERIMENTS)
               if n.endswith(".py") and not n.startswith("_")}
    assert on_disk and on_disk <= listed


def test_list_says_how_long_each_section_took_in_the_last_run_where_it_recorded_that(tmp_path):
    import json

    (tmp_path / "run.json").write_text(json.dumps({"section_s": {"scrape": 61.4}}))
    text = _catalogue.listing(str(tmp_path / "run.json"))
    assert "full: about 1 min; last full run 61 s; --quick" in text and text.count("last full run") == 1
    assert "last full run" not in _catalogue.listing(str(tmp_path / "missing.json"))


def test_every_listed_benchmark_imports_and_bench_holds_no_unlisted_entry_point():
    listed = {b.module for b in (*_catalogue.BENCHMARKS, _catalogue.GPU)}
    listed |= {part for b in _catalogue.BENCHMARKS for part in b.parts}
    listed |= {module for module, _ in _catalogue.experiments()}
    for module in sorted(listed):
        importlib.import_module(module)
    # A module of bench/ itself that can run (``python -m``) is a section, part of one, or listed as hand-run:
    # a new experiment goes under bench/experiments/, where --list finds it.
    for name in os.listdir(BENCH):
        if name.endswith(".py") and not name.startswith("_"):
            source = open(os.path.join(BENCH, name)).read()
            if 'if __name__ == "__main__"' in source:
                assert f"bench.{name[:-3]}" in listed, f"bench/{name} runs but python -m bench --list does not name it"


def test_bench_has_no_import_cycles():
    modules = _modules()
    graph = {module: _imports(module, path, set(modules)) for module, path in modules.items()}
    assert graph["bench.overhead"] >= {"bench._loops", "bench.ddp_origin"}  # the parser sees both kinds of import
    assert _cycle(graph) == []
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # and the search finds one


def test_bench_examples_and_tests_import_what_they_share_normally():
    """What tests, benchmarks and the demo share is the installed ``ampwatch_support``: no file adds a folder of
    the repository to ``sys.path`` to reach it, and no test imports a benchmark's module for it."""
    hacks, from_bench = [], []
    for folder in ("bench", "examples", "docs", "tests", "agent/tests", "server/tests", "dashboards/tests",
                   "contract/tests", "support"):
        for path in sorted(glob.glob(os.path.join(ROOT, folder, "**", "*.py"), recursive=True)):
            tree = ast.parse(open(path).read())
            for node in ast.walk(tree):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in ("insert", "append") and ast.unparse(node.func.value) == "sys.path"):
                    hacks.append(os.path.relpath(path, ROOT))
                if (folder.endswith("tests") and isinstance(node, ast.ImportFrom) and node.module
                        and node.module.startswith("bench") and not os.path.basename(path).startswith("test_bench")):
                    from_bench.append(f"{os.path.relpath(path, ROOT)}: {node.module}")
    assert hacks == [] and from_bench == []
    assert importlib.util.find_spec("ampwatch_support.collector_process") is not None


def _section_of(lines: list[str], index: int) -> str:
    return next(line for line in reversed(lines[:index]) if line.startswith("## "))


def _block(name: str, text: str) -> list[str]:
    return [f"<!-- hand-written: {name} -->", text, f"<!-- end hand-written: {name} -->"]


def test_a_re_render_keeps_each_hand_written_block_in_its_place(tmp_path):
    import shutil

    import pytest

    from bench.report._hand_written import blocks
    json_path = tmp_path / "benchmarks.json"
    shutil.copy(os.path.join(ROOT, "docs", "benchmarks.json"), json_path)
    page = tmp_path / "benchmarks.md"
    assert bench_main.main(["--render", str(json_path)]) == 0
    lines = page.read_text().split("\n")
    # after_line: after a rendered line; its neighbour right after it; at_end: its anchor line edited by hand (so
    # absent from the next render), it goes to the end of its section; orphan: its section is gone.
    scrape = lines.index("## 3. Scrape cost")
    anchor = next(k for k in range(scrape + 1, len(lines)) if lines[k].startswith("|"))
    anchor_line = lines[anchor]
    lines[anchor + 1:anchor + 1] = _block("after_line", "Kept after the table's first line.") + \
        _block("neighbour", "Kept right after the block before it.")
    # after_caption: after a result's caption as an earlier run dated it (a re-measured result's caption changes);
    # after_third: after the third of identical lines in its section (a table's separator row).
    fleet_heading = next(line for line in lines if line.startswith("## 9. "))
    fleet = lines.index(fleet_heading)
    caption = next(k for k in range(fleet, len(lines)) if lines[k].startswith("`python -m bench.experiments.fleet "))
    caption_line = lines[caption]
    assert ", 2026-" in caption_line
    lines[caption] = caption_line.replace(", 2026-", ", 2025-", 1)
    lines[caption + 1:caption + 1] = _block("after_caption", "Kept after the re-measured result's caption.")
    separators = [k for k in range(fleet, len(lines)) if lines[k] == "|---|---|---|" and _section_of(lines, k) ==
                  fleet_heading]
    assert len(separators) >= 4
    lines[separators[2] + 1:separators[2] + 1] = _block("after_third", "Kept after the third separator.")
    overhead = lines.index("## 1. Agent overhead per training iteration")
    lines[overhead + 2] += " (edited by hand)"
    lines[overhead + 3:overhead + 3] = ["", *_block("at_end", "Kept at the end of section 1."), ""]
    last = lines.index("## How it is measured")
    lines[last:last] = ["## 99. A section no render makes", "", *_block("orphan", "Kept, not dropped."), ""]
    page.write_text("\n".join(lines))
    assert bench_main.main(["--render", str(json_path)]) == 0
    again = page.read_text()
    new = again.split("\n")
    assert "## 99. A section no render makes" not in new and "(edited by hand)" not in again
    assert [b.name for b in blocks(again)] == ["at_end", "after_line", "neighbour", "after_caption", "after_third",
                                               "orphan"]
    assert new[new.index("<!-- hand-written: after_caption -->") - 2] == caption_line
    third = new.index("<!-- hand-written: after_third -->")
    assert new[third - 2] == "|---|---|---|" and _section_of(new, third) == fleet_heading
    assert sum(line == "|---|---|---|" for line in new[new.index(fleet_heading):third]) == 3
    start = new.index("<!-- hand-written: after_line -->")
    assert new[start - 2] == anchor_line and new[start + 4] == "<!-- hand-written: neighbour -->"
    assert _section_of(new, start) == "## 3. Scrape cost"
    at_end = new.index("<!-- hand-written: at_end -->")
    assert _section_of(new, at_end) == "## 1. Agent overhead per training iteration"
    assert new[at_end + 4].startswith("## ")  # the last thing in its section
    orphan = new.index("<!-- hand-written: orphan -->")
    assert new[orphan + 4] == "## How it is measured"
    # Rendering again changes nothing.
    assert bench_main.main(["--render", str(json_path)]) == 0
    assert page.read_text() == again
    # A block left open or named twice is refused with what to do, before the page is overwritten.
    page.write_text(again.replace("<!-- end hand-written: orphan -->", ""))
    with pytest.raises(ValueError, match="'orphan' has no closing line"):
        bench_main.main(["--render", str(json_path)])
    page.write_text(again.replace("hand-written: neighbour", "hand-written: after_line"))
    with pytest.raises(ValueError, match="two hand-written blocks are named 'after_line'"):
        bench_main.main(["--render", str(json_path)])
    assert "hand-written: after_line" in page.read_text()


def test_a_stored_result_says_the_commit_it_ran_at_and_its_caption_shows_it(tmp_path):
    import json
    import subprocess

    from bench._before_after import store
    from bench.report._format import measured_by
    store(str(tmp_path / "r.json"), "k", {"after": {}}, ["prog", "--out", "r.json"], module="experiments.k")
    stored = json.loads((tmp_path / "r.json").read_text())["k"]
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    assert stored["commit"].split(" ")[0] == head.stdout.strip()
    assert stored["command"] == "python -m bench.experiments.k --out r.json"
    assert f", at commit {stored['commit']}, load average " in measured_by(stored)
    # Every result the page renders from says its commit (backfilled for those stored before commits were).
    for name in os.listdir(os.path.join(BENCH, "experiments", "results")):
        document = json.loads(open(os.path.join(BENCH, "experiments", "results", name)).read())
        for key, result in document.items():
            assert not (isinstance(result, dict) and "date" in result) or result.get("commit"), (name, key)


def test_a_before_side_runs_the_earlier_commits_collector_and_a_side_that_did_not_is_refused(tmp_path):
    """The earlier commit's folders go first on the child's path; a side that imported this tree's collector
    instead (as the ``-c`` children once did: one path entry made of two) raises rather than compare a tree
    with itself."""
    import pytest

    from bench._before_after import checked_side, source_of
    from bench.experiments import ingest_cpu

    path = source_of("HEAD", str(tmp_path))
    before = ingest_cpu._side(4, 1, path, storm=True)
    assert before["server"].startswith(str(tmp_path)) and before["ok"] == before["updates"] == 4
    assert ingest_cpu._side(4, 1, None)["server"].startswith(ROOT)
    with pytest.raises(RuntimeError, match="the before side imported the collector from"):
        checked_side({"server": os.path.join(ROOT, "server", "src", "ampwatch", "server", "__init__.py")}, path)


def test_the_scrape_summary_says_slower_where_the_collector_is_slower_than_the_pushgateway():
    from bench.report import scrape
    levels = [{"target": "ampwatch", "ranks": 1024, "scrape_median_ms": 78.0, "bytes": 2_200_000},
              {"target": "pushgateway", "ranks": 1024, "scrape_median_ms": 49.8, "bytes": 3_200_000},
              {"target": "ampwatch", "ranks": 4096, "scrape_median_ms": 103.9, "bytes": 8_700_000},
              {"target": "pushgateway", "ranks": 4096, "scrape_median_ms": 304.2, "bytes": 13_000_000}]
    rows = scrape.summary_rows({"levels": levels})
    assert rows[0].endswith("| 1.6x slower |") and rows[1].endswith("| 2.9x faster |")


def _rendered(tmp_path) -> list[str]:
    import shutil

    json_path = tmp_path / "benchmarks.json"
    shutil.copy(os.path.join(ROOT, "docs", "benchmarks.json"), json_path)
    assert bench_main.main(["--render", str(json_path)]) == 0
    return (tmp_path / "benchmarks.md").read_text().split("\n")


def test_each_measured_section_opens_with_its_table_and_says_how_after_it(tmp_path):
    # A reader after a figure finds a table first: at most a one-line lead-in before it (the stamp of a
    # re-measured section aside), and the method's paragraphs after it.
    lines = _rendered(tmp_path)
    headings = [k for k, line in enumerate(lines) if line.startswith("## ") and line[3].isdigit()]
    assert len(headings) >= 10
    for k in headings:
        table = next(j for j in range(k + 1, len(lines)) if lines[j].startswith("|"))
        lead = [line for line in lines[k + 1:table] if line.strip() and not line.startswith("Re-measured by ")]
        assert len(lead) <= 1 and all(len(line) <= 300 for line in lead), (lines[k], lead)
        assert not any(line.startswith("## ") for line in lines[k + 1:table]), lines[k]


def test_the_by_job_size_table_takes_each_row_from_the_section_it_links_and_orders_rows_by_ranks():
    from bench.report import by_scale

    res = {"ingest": {"paced": [
        {"target": "ampwatch", "ranks": 4096, "updates_per_s": 2748.4, "offered_per_s": 4096.0, "p99_ms": 1308.6},
        {"target": "pushgateway", "ranks": 1024, "updates_per_s": 51.0, "offered_per_s": 1024.0, "p99_ms": 14245.0},
        {"target": "ampwatch", "ranks": 1024, "updates_per_s": 1024.0, "offered_per_s": 1024.0, "p99_ms": 8.5}]},
        "scrape": {"levels": [{"target": "ampwatch", "ranks": 1024, "scrape_median_ms": 78.02,
                               "rss_kib_per_rank": 14.4}]}}
    fleet = {"fleet_16384": {"settings": {"heartbeat_s": 30.0, "storm_share": 0.1, "lockstep": False}, "after": {
        "ranks": 16384, "healthy": {"requests_per_s": 546.1, "latency": {"p99_ms": 308.3},
                                    "collector_kib_per_rank": 22.0},
        "storm": {"latency": {"p99_ms": 1552.7}}}}}
    links = {"ingest": "[section 2](#2)", "scrape": "[section 3](#3)", "job1024": "[section 7](#7)",
             "fleet": "[section 9](#9)"}
    lines = by_scale.section(res, None, fleet, links)
    rows = [line.split(" | ") for line in lines if line.startswith("| ") and line[2].isdigit()]
    assert [row[0] for row in rows] == ["| 1,024", "| 4,096", "| 16,384"]  # the Pushgateway's row is not ours
    assert rows[0][2:7] == ["1,024.0", "8.5", "-", "78.0", "14.4"]
    assert rows[0][7] == "[section 2](#2), [section 3](#3) |"
    assert rows[1][2] == "2,748.4 of 4,096 asked" and rows[1][5] == "-" and rows[1][7] == "[section 2](#2) |"
    assert rows[2][2:7] == ["546.1", "308.3", "1,552.7", "-", "22.0"] and rows[2][7] == "[section 9](#9) |"
    assert by_scale.section({}, None, None, links) == []


def test_the_spike_rows_are_judged_against_1_percent_and_merged_without_touching_the_rest(tmp_path):
    import json
    import shutil

    from bench.instructions import merge_spikes
    from bench.report import instructions

    def row(watched: str, ratio: float, judged: bool) -> dict:
        return {"model": "transformer", "optimizer": "AdamW(foreach=True)", "precision": "GradScaler", "ddp": False,
                "iterations": 200, "bare_per_iter": 10_000, "watched_per_iter": round(10_000 * ratio),
                "agent_per_iter": round(10_000 * (ratio - 1)), "ratio": ratio, "bare": "bare_clip",
                "watched": watched, "judged": judged,
                "grad_norm": "grad_norm=True" if watched == "ampwatch_norm" else "watch.grad_norm"}
    spikes = [row("ampwatch_clip", 1.0099, True), row("ampwatch_clip", 1.0101, True), row("ampwatch_norm", 1.05, False)]
    path = tmp_path / "benchmarks.json"
    shutil.copy(os.path.join(ROOT, "docs", "benchmarks.json"), path)
    earlier = json.loads(path.read_text())
    merge_spikes({"spikes": spikes, "warmup": 20}, str(path), "python -m bench.instructions --spikes")
    merged = json.loads(path.read_text())
    stamp = merged["instructions"].pop("spikes_measured")
    assert merged["instructions"].pop("spikes") == spikes
    assert stamp["command"] == "python -m bench.instructions --spikes" and stamp["warmup"] == 20
    earlier["instructions"].pop("spikes", None)
    earlier["instructions"].pop("spikes_measured", None)
    assert merged == earlier
    ins = {**earlier["instructions"], "spikes": spikes, "spikes_measured": stamp}
    table = [line for line in instructions.section(ins) if "`bare_clip`" in line]
    assert [line.rsplit("|", 2)[1].strip() for line in table] == ["yes", "**no** (1.01%)", "not targeted"]
    assert [line.rsplit(", ", 1)[1] for line in instructions.summary_rows(ins)[-3:]] == [
        "within 1% |", "over the 1% target |", "not targeted |"]
    norm = {**row("ampwatch_norm", 1.05, False), "bare": "bare", "bare_per_iter": 9_000}
    assert instructions._against_clipping([norm, spikes[0]]) == [
        "", "What the agent's norm costs beside the job computing it itself, per iteration: AdamW(foreach=True): +500 "
            "with `grad_norm=True`, +1,000 for the job's own `unscale_` + `clip_grad_norm_` (`bare_clip` beside "
            "`bare`)."]
