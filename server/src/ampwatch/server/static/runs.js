// The status page's run list (GET /v1/runs): with --peers, every replica's runs and the replicas not answering.
// User strings only ever go through textContent or setAttribute (page.js).
"use strict";

const MAX_PAGES = 20;            // run list pages read per refresh: bounded work however many runs
const RUNS_PER_PAGE = 50;
let runPagesShown = 1;  // "More runs" adds a page; each refresh reads that many pages of GET /v1/runs

// A replica's state (GET /v1/runs' replicas) in words: it answered its last ask, refused it, or let it time out.
const REPLICA_WORDS = {down: "down", slow: "not answering"};

function isPageURL(url) {
  return typeof url === "string" && /^https?:\/\/[^\s/]+$/.test(url);
}

// The run's view on the page of the replica holding it.
function replicaRunPage(replica, run) {
  return `${replica}/#run=${encodeURIComponent(run)}`;
}

function replicaCell(row, replicas) {
  const cell = el("td", {class: "replica"});
  if (!isPageURL(row.replica)) return cell;
  cell.append(el("a", {href: replicaRunPage(row.replica, row.run), class: "replica-link"},
                 row.replica.replace(/^https?:\/\//, "")));
  const state = (replicas.get(row.replica) || {}).state;
  if (state && state !== "up") cell.append(" ", el("span", {class: "replica-state"}, `(${REPLICA_WORDS[state] || state})`));
  // A run bigger than --block-ranks lies in blocks on several replicas: this row is this replica's blocks of it.
  if (row.split) {
    cell.append(" ", el("span", {class: "muted split"},
      `block${row.split.blocks.length > 1 ? "s" : ""} ${row.split.blocks.map(b => b + 1).join(", ")} of ${row.split.of}`));
  }
  return cell;
}

// A run this replica holds opens here; another replica's opens on that replica's page.
function runCell(row, replicas) {
  const here = !row.replica || (replicas.get(row.replica) || {}).self;
  const link = runLink(row.run);
  if (!here && isPageURL(row.replica)) link.setAttribute("href", replicaRunPage(row.replica, row.run));
  return el("td", {}, link);
}

function ageText(seconds) {
  return seconds === null || seconds === undefined ? "never" : ago(Date.now() / 1000 - seconds);
}

// One line per replica that did not answer its last ask: what happened, and how old its runs listed are.
function replicaLines(replicas) {
  return replicas.filter(r => r.state !== "up").map(r => el("li", {class: "replica-down", "data-replica": r.url,
      "data-state": r.state},
    el("b", {}, r.url), ` ${REPLICA_WORDS[r.state] || r.state}` + (r.error ? ` (${r.error})` : "") +
    `, checked ${ageText(r.checked_age)}: ` + (r.answer_age === null ? "none of its runs are listed"
      : `its runs as it listed them ${ageText(r.answer_age)}`)));
}

async function refreshRuns() {
  let runs = [], next = null, replicas = null;
  for (let page = 0; page < Math.min(runPagesShown, MAX_PAGES); page++) {
    const after = next === null ? "" : `&after=${encodeURIComponent(next)}`;
    const body = await getJSON(`v1/runs?limit=${RUNS_PER_PAGE}${after}`);
    runs = runs.concat(body.runs || []);
    replicas = replicas || body.replicas || null;  // with --peers only
    next = body.next ?? null;
    if (next === null) break;
  }
  const fleet = new Map((replicas || []).map(r => [r.url, r]));
  document.getElementById("more-runs").hidden = next === null;
  document.getElementById("runs-replica").hidden = replicas === null;
  fill(document.querySelector("#runs tbody"), runs.map(r => el("tr", {class: "run", "data-run": r.run},
    runCell(r, fleet),
    el("td", {class: "num"}, r.ranks),
    el("td", {}, ago(r.first_seen)),
    el("td", {}, ago(r.last_seen)),
    el("td", {}, r.in_metrics ? "yes" : "no"),
    replicas === null ? null : replicaCell(r, fleet))));
  const down = replicaLines(replicas || []);
  fill(document.getElementById("replicas-down"), down);
  document.getElementById("replicas-down").hidden = down.length === 0;
  document.getElementById("replicas").textContent = replicas === null ? "" :
    `of ${plural(replicas.length, "replica")}, ${replicas.length - down.length} answering`;
  document.getElementById("no-runs").hidden = runs.length !== 0;
}
