// The status page's run list (GET /v1/runs).
// User strings only ever go through textContent or setAttribute (page.js).
"use strict";

const MAX_PAGES = 20;            // run list pages read per refresh: bounded work however many runs
const RUNS_PER_PAGE = 50;
let runPagesShown = 1;  // "More runs" adds a page; each refresh reads that many pages of GET /v1/runs

async function refreshRuns() {
  let runs = [], next = null;
  for (let page = 0; page < Math.min(runPagesShown, MAX_PAGES); page++) {
    const after = next === null ? "" : `&after=${encodeURIComponent(next)}`;
    const body = await getJSON(`v1/runs?limit=${RUNS_PER_PAGE}${after}`);
    runs = runs.concat(body.runs || []);
    next = body.next ?? null;
    if (next === null) break;
  }
  document.getElementById("more-runs").hidden = next === null;
  fill(document.querySelector("#runs tbody"), runs.map(r => el("tr", {class: "run", "data-run": r.run},
    el("td", {}, runLink(r.run)),
    el("td", {class: "num"}, r.ranks),
    el("td", {}, ago(r.first_seen)),
    el("td", {}, ago(r.last_seen)),
    el("td", {}, r.in_metrics ? "yes" : "no"))));
  document.getElementById("no-runs").hidden = runs.length !== 0;
}

