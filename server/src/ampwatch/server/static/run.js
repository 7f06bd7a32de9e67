// The status page's run view: ranks in trouble, the run's banner, every rank (GET /v1/runs/{run}, /summary).
// User strings only ever go through textContent or setAttribute (page.js).
"use strict";

let scaleWindow = "1000";  // the chart's window: the last N iterations, or "all"

// ---- one run ----------------------------------------------------------------------------------

function optimizerCell(rank) {
  const cell = el("td", {});
  for (const [name, o] of Object.entries(rank.optimizers || {})) {
    const line = el("div", {class: "optimizer", "data-optimizer": name});
    line.append(el("b", {}, name), `: ${o.skipped} / ${o.steps}, streak `);
    line.append(el("span", {class: o.consecutive_skipped > 0 ? "streak" : ""}, String(o.consecutive_skipped)));
    line.append(` (${o.longest_streak})`);
    if (o.poisoned_steps > 0) {
      // A poisoned optimizer's weights are likely NaN for good: say so loudly, and only then.
      line.append(" · ", el("span", {class: "poisoned", title: "steps that updated parameters with non-finite " +
        "gradients or left them non-finite (AmpPoisonedStep): restore from a checkpoint"},
        `poisoned ${o.poisoned_steps}`));
    }
    if (o.latest_nonfinite_parameter) line.append(" · last non-finite: ", el("span", {class: "params"}, o.latest_nonfinite_parameter));
    cell.append(line);
  }
  return cell;
}

function scalerText(scaler) {
  if (scaler && scaler.enabled) return scaler.kind || "enabled";
  // kind "none": a job without a GradScaler (bf16, float32); every step is checked for inf/NaN gradients.
  if (scaler && scaler.kind === "none") return "none (bf16/fp32: every step checked)";
  // enabled=False (the usual bf16 recipe): it scales and skips nothing; the agent checks every step instead.
  return "disabled (every step checked)";
}

function hostCell(rank) {
  const cell = el("td", {}, rank.host);
  // An agent before process_key: anyone holding the ingest token can speak for this rank (docs/security.md).
  if (rank.keyless) cell.append(" ", el("span", {class: "keyless muted", title: "this rank's agent sends no " +
    "process key (an agent before it): its batches cannot be told from a forger's. Upgrade the agent"}, "no key"));
  return cell;
}

function rankRow(rank) {
  const enabled = rank.scaler && rank.scaler.enabled;
  const unscaled = rank.scaler && rank.scaler.kind === "none";
  return el("tr", {class: "rank", "data-rank": rank.rank},
    el("td", {class: "num"}, rank.rank),
    hostCell(rank),
    el("td", {class: enabled || unscaled ? "" : "disabled"}, scalerText(rank.scaler)),
    el("td", {class: "num loss-scale"}, enabled ? scaleText(rank.loss_scale) : "-"),
    el("td", {class: "num"}, rank.iteration),
    optimizerCell(rank),
    el("td", {class: "num"}, `${rank.backoffs ?? 0} / ${rank.growths ?? 0}`),
    el("td", {class: "num origin" + (rank.origin_iterations > 0 ? " streak" : "")},
      rank.origin_iterations === null || rank.origin_iterations === undefined ? "-" : String(rank.origin_iterations)),
    el("td", {}, rank.closed ? `closed, ${ago(rank.last_seen)}` : ago(rank.last_seen)));
}

const TROUBLE_ROWS = 50;  // one page of the summary: ranks in trouble first, most urgent reason first
const REASON_WORDS = {
  poisoned: "poisoned", silent: "silent", collapsed: "scale collapsed", in_streak: "skipping now",
  long_streak: "long streak", high_skip_ratio: "high recent skip ratio", alert: "alert firing",
  desynced: "scale out of line",
};
// A finished run's rows say what happened over its life (GET /v1/runs/{run}/summary: counts_cover "whole_run").
const LIFE_WORDS = {
  collapsed: "scale ended collapsed", high_skip_ratio: "high skip ratio", alert: "alert fired",
  desynced: "scale ended out of line",
};

function reasonWords(reason, finished) {
  return (finished && LIFE_WORDS[reason]) || REASON_WORDS[reason] || reason;
}

function troubleRow(row, finished) {
  const why = el("td", {});
  for (const reason of row.reasons) why.append(el("span", {class: "reason", "data-reason": reason}, reasonWords(reason, finished)));
  if (row.alerts.length) why.append(el("span", {class: "muted"}, row.alerts.join(", ")));
  const calls = row.steps + row.skipped;
  const longest = row.longest_streak ?? row.streak;
  return el("tr", {class: "trouble", "data-rank": row.rank},
    el("td", {class: "num"}, row.rank), el("td", {}, row.host), why,
    // null: no scale to show (no GradScaler, a disabled one, or none read yet)
    el("td", {class: "num"}, row.loss_scale === null ? "-" : scaleText(row.loss_scale)),
    el("td", {class: "num"}, row.iteration),
    el("td", {class: "num" + (row.streak > 0 ? " streak" : "")}, longest > row.streak ? `${row.streak} (${longest})` : row.streak),
    el("td", {class: "num"}, `${percent(row.recent_skip_ratio)} / ${percent(calls ? row.skipped / calls : null)}`),
    el("td", {class: row.reasons.includes("silent") ? "streak" : ""},
       row.closed ? `closed, ${ago(row.last_seen)}` : ago(row.last_seen)));
}

// The loss scale across ranks: min, median and max, collapsed ranks (0, NaN, below 1) counted, not left out.
function bandText(band, finished) {
  const what = finished ? "final loss scale" : "loss scale";
  if (!band.ranks) return band.no_scale ? `no loss scale (${plural(band.no_scale, "rank")} without a GradScaler)` : `${what} unknown`;
  let text = band.min === band.max && band.min !== null ? `${what} ${scaleText(band.min)} on every rank`
    : `${what} min ${scaleText(band.min)}, median ${scaleText(band.median)}, max ${scaleText(band.max)}`;
  if (band.collapsed) text += ` (${band.collapsed === band.ranks ? "all" : band.collapsed.toLocaleString("en-US")} collapsed)`;
  if (band.no_scale) text += `; ${plural(band.no_scale, "rank")} without a loss scale`;
  return text;
}

// A run-wide line above the rows: a whole-job skip storm, or what a finished run went through.
function runBanner(body) {
  const banner = document.getElementById("run-banner");
  const job = body.whole_job, life = body.life;
  banner.replaceChildren();
  banner.className = "banner";
  if (body.closed) {
    banner.classList.add("finished");
    const fired = life.alerts_fired.map(a => `${a.name} (${a.severity}${a.ranks > 1 ? `, ${a.ranks} ranks` : ""})`);
    banner.append(el("b", {}, "Finished run"),
      `: ${plural(body.ranks, "rank")} closed after ${plural(life.iterations, "iteration")}; ` +
      `${life.skipped.toLocaleString("en-US")} of ${plural(life.step_calls, "step")} skipped (${percent(life.skip_ratio)}), ` +
      `${plural(life.streaks, "streak")}, the longest ${life.longest_streak}` +
      (life.longest_streak_rank !== null ? ` (rank ${life.longest_streak_rank})` : "") + "; ",
      life.poisoned_steps ? el("span", {class: "poisoned"}, `${plural(life.poisoned_steps, "poisoned step")} on ${plural(life.poisoned_ranks, "rank")}`)
                          : "no poisoned step",
      `; ${bandText(body.scale, true)}; ` +
      (fired.length ? `alerts that fired: ${fired.join(", ")}` : "no built-in alert fired"));
  } else if (job) {
    banner.classList.add("storm");
    banner.append(el("b", {}, "Whole job skipping"),
      `: ${job.skipping.toLocaleString("en-US")} of ${plural(job.live, "live rank")} in a skip streak, ` +
      (job.since_ranks < job.skipping ? `${job.since_ranks.toLocaleString("en-US")} of them ` : "") +
      `since iteration ${job.since_iteration} · ${bandText(body.scale, false)}`);
  }
  banner.hidden = !banner.childNodes.length;
}

// Return the summary (null when the run is not in memory).
async function refreshTrouble(run) {
  const search = document.getElementById("trouble-search").value.trim();
  const query = `limit=${TROUBLE_ROWS}` + (search ? `&search=${encodeURIComponent(search)}` : "");
  let body;
  try {
    body = await getJSON(`v1/runs/${encodeURIComponent(run)}/summary?${query}`);
  } catch (error) {
    document.getElementById("trouble-box").hidden = true;  // a run no longer in memory: the table below still shows it
    return null;
  }
  const finished = body.counts_cover === "whole_run";
  document.getElementById("trouble-box").hidden = false;
  runBanner(body);
  document.getElementById("trouble-title").textContent = finished ? "Ranks that had trouble" : "Ranks in trouble";
  document.getElementById("trouble-count").textContent = `${body.in_trouble} of ${body.ranks}`;
  const counts = Object.entries(body.counts).filter(([, n]) => n > 0).map(([r, n]) => `${reasonWords(r, finished)}: ${n}`);
  const scope = finished ? "over the whole run" : `now, of ${plural(body.live_ranks, "live rank")}`;
  document.getElementById("trouble-summary").textContent =
    (counts.length ? `${scope}: ${counts.join(" · ")}` : finished ? "no rank had trouble" : "every live rank looks fine") +
    ` — ${bandText(body.scale, finished)}` +
    (body.run_alerts.length ? ` — run alerts: ${body.run_alerts.join(", ")}` : "");
  // Without a search, only ranks in trouble; with one, every match.
  const rows = search ? body.rows : body.rows.filter(row => row.reasons.length);
  fill(document.querySelector("#trouble tbody"), rows.map(row => troubleRow(row, finished)));
  const more = document.getElementById("trouble-more");
  const left = (search ? body.matched : body.in_trouble) - rows.length;
  more.hidden = left <= 0;
  more.textContent = `${left} more not shown: search for a rank, host or reason.`;
  return body;
}

const BIG_RUN = 64;              // ranks from which the full rank table is fetched only while it is open
const allRanksChosen = new Set();  // runs whose "All ranks" the reader opened or closed

const CHART_ASKED = 10;  // ranks in trouble the chart draws besides the ones furthest from the median

function showRunState(run, closed) {
  document.getElementById("run-name").textContent = run;
  const state = document.getElementById("run-state");
  state.textContent = closed ? "closed" : "live";
  state.className = "badge " + (closed ? "state-closed" : "state-live");
}

// The rest of a run's view, once its summary (refreshTrouble) drew the ranks in trouble.
async function refreshRun(run, summary) {
  const allRanks = document.getElementById("all-ranks");
  const big = summary !== null && summary.ranks >= BIG_RUN;
  if (!allRanksChosen.has(run) && allRanks.open === big) allRanks.open = !big;  // closed by default for big runs only
  const history = drawRunHistory(run, summary);
  if (big && !allRanks.open) {
    // About 1 MB at 1,024 ranks: not fetched every few seconds unless asked for.
    showRunState(run, summary.closed);
    fill(document.querySelector("#ranks tbody"), []);
    await history;
    return;
  }
  let body;
  try {
    body = await getJSON(`v1/runs/${encodeURIComponent(run)}`);
  } catch (error) {
    document.getElementById("run-name").textContent = run;
    document.getElementById("run-state").textContent = "unknown run";
    fill(document.querySelector("#ranks tbody"), []);
    await history;
    return;
  }
  showRunState(body.run, body.closed);
  fill(document.querySelector("#ranks tbody"), body.ranks.map(rankRow));
  await history;
}

// The chart's data: the spread and outliers over the chosen window, with the ranks in trouble drawn too.
async function fetchScale(run, summary) {
  if (summary === null) return null;  // not in memory: no scale history held
  const asked = summary.rows.filter(row => row.reasons.length).slice(0, CHART_ASKED).map(row => row.rank);
  try {
    return await getJSON(`v1/runs/${encodeURIComponent(run)}/scale?window=${scaleWindow}&ranks=${asked.join(",")}`);
  } catch (error) {
    return null;
  }
}
