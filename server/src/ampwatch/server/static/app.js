// ampwatch status page: reads the collector's JSON API and redraws itself every few seconds.
// Every user-provided string (run ids, hosts, parameter names) goes through textContent or
// setAttribute, never as HTML, so nothing a rank sends can become markup.
"use strict";

const REFRESH_MS = 3000;
const MAX_EVENTS_SHOWN = 100;
const MAX_PAGES = 20;            // run list pages read per refresh: bounded work however many runs
const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"];
const SVG = "http://www.w3.org/2000/svg";
// poisoned_step reasons (docs/protocol.md) in words.
const POISON_REASONS = {
  nonfinite_grad: "stepped with non-finite gradients",
  nonfinite_param: "parameters non-finite after the step",
};

let scaleWindow = "1000";  // the chart's window: the last N iterations, or "all"

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

// ---- the read token (--read-token) ------------------------------------------------------------
// Asked for once on a 401, kept in sessionStorage (this tab only, gone when it closes), sent as a
// bearer header, never put in a URL.

const TOKEN_KEY = "ampwatch-read-token";

class NeedsToken extends Error {}

function askForToken(wrong) {
  const form = document.getElementById("token-form");
  document.getElementById("token-wrong").hidden = !wrong;
  form.hidden = false;
  document.getElementById("token").focus();
}

document.getElementById("token-form").addEventListener("submit", event => {
  event.preventDefault();
  const input = document.getElementById("token");
  if (!input.value.trim()) return;
  sessionStorage.setItem(TOKEN_KEY, input.value.trim());
  input.value = "";
  document.getElementById("token-form").hidden = true;
  refresh();
});

async function getJSON(path) {
  const headers = {Accept: "application/json"};
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers.Authorization = `Bearer ${token}`;
  const answer = await fetch(path, {headers, cache: "no-store"});
  if (answer.status === 401 || (answer.status === 403 && token)) {
    if (token) sessionStorage.removeItem(TOKEN_KEY);
    throw new NeedsToken(token ? "wrong" : "missing");
  }
  if (!answer.ok) throw new Error(`${path}: HTTP ${answer.status}`);
  return answer.json();
}

function ago(seconds) {
  if (seconds === null || seconds === undefined) return "";
  const s = Math.max(0, Date.now() / 1000 - seconds);
  if (s < 60) return `${Math.round(s)} s ago`;
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  if (s < 86400) return `${(s / 3600).toFixed(1)} h ago`;
  return `${(s / 86400).toFixed(1)} d ago`;
}

function clock(seconds) {
  return new Date(seconds * 1000).toLocaleTimeString();
}

function scaleNumber(scale) {
  // The protocol writes NaN and infinities as the strings "NaN", "Infinity", "-Infinity" (JSON has no such numbers).
  return typeof scale === "string" ? Number(scale) : scale;
}

function scaleText(scale) {
  if (scale === null || scale === undefined) return "unknown";
  const value = scaleNumber(scale);
  const exponent = Math.log2(value);
  return Number.isInteger(exponent) ? `2^${exponent} (${value})` : String(value);
}

function onLogAxis(scale) {
  // 0, negative, NaN and infinite scales (a collapsed or broken scaler) have no place on a log2 axis.
  return Number.isFinite(scale) && scale > 0;
}

function fill(tbody, rows) {
  tbody.replaceChildren(...rows);
}

function currentRun() {
  const match = /^#run=(.*)$/.exec(location.hash);
  return match ? decodeURIComponent(match[1]) : null;
}

function runLink(run) {
  return el("a", {href: "#run=" + encodeURIComponent(run), class: "run-link"}, run);
}

// ---- alerts -----------------------------------------------------------------------------------

function alertRow(alert, when) {
  const labels = alert.labels || {};
  const severity = labels.severity || "";
  const title = el("td", {}, alert.name);
  const runbook = (alert.annotations || {}).runbook_url;
  if (runbook && /^https?:\/\//.test(runbook)) title.append(" ", el("a", {href: runbook, rel: "noopener"}, "runbook"));
  return el("tr", {class: "alert", "data-alert": alert.name},
    title,
    el("td", {}, el("span", {class: "badge sev-" + severity.replace(/[^a-z]/g, "")}, severity)),
    el("td", {}, labels.run ? runLink(labels.run) : ""),
    el("td", {}, labels.rank ?? ""),
    el("td", {}, labels.optimizer ?? ""),
    el("td", {title: (alert.annotations || {}).description || ""}, (alert.annotations || {}).summary || ""),
    el("td", {}, when));
}

const expandedGroups = new Set();  // collapsed alert rows (name, run, severity) the reader opened
const GROUP_FROM = 5;  // alerts of one alert, run and severity from which the collector sends them as one entry

function groupKey(alert) {
  const labels = alert.labels || {};
  return [alert.name, labels.run ?? "", labels.severity ?? ""].join("\u0000");
}

// A whole-job storm is thousands of per-rank alerts: the collector sends five or more of one alert, run and
// severity as one entry (count, ranks), shown as one row that expands; its members are fetched only while open.
function alertRows(alerts, whenOf, members) {
  const rows = [];
  for (const a of alerts) {
    if (!a.group) {
      rows.push(alertRow(a, whenOf(a)));
      continue;
    }
    const key = groupKey(a), open = expandedGroups.has(key);
    const head = alertRow(a, whenOf(a));
    head.className = "alert-group";
    head.setAttribute("aria-expanded", String(open));
    head.cells[3].textContent = `${a.ranks} ranks: ${a.rank_ranges}`;
    head.cells[4].textContent = `${a.count} alerts ${open ? "▾" : "▸"}`;
    head.addEventListener("click", () => {
      if (open) expandedGroups.delete(key); else expandedGroups.add(key);
      refreshAlerts();
    });
    rows.push(head);
    if (!open) continue;
    for (const m of members.get(key) || []) {
      if (groupKey(m) !== key || m.status !== a.status) continue;
      const row = alertRow(m, whenOf(m));
      row.classList.add("member");
      rows.push(row);
    }
  }
  return rows;
}

async function refreshAlerts() {
  const members = new Map();
  let body;
  try {
    body = await getJSON(`v1/alerts?collapse=${GROUP_FROM}`);
    const open = [...expandedGroups];
    const lists = await Promise.all(open.map(key => {
      const [name, run] = key.split("\u0000");
      return getJSON(`v1/alerts?alertname=${encodeURIComponent(name)}&run=${encodeURIComponent(run)}`);
    }));
    open.forEach((key, i) => members.set(key, [...(lists[i].firing || []), ...(lists[i].resolved || [])]));
  } catch (error) {
    if (error instanceof NeedsToken) throw error;
    document.getElementById("no-firing").textContent = "Built-in alerts are not available on this collector.";
    return;
  }
  renderAlerts(body, members);
}

function renderAlerts(body, members) {
  const firing = body.firing || [], resolved = body.resolved || [];
  fill(document.querySelector("#firing tbody"), alertRows(firing, a => ago(a.starts_at), members));
  document.getElementById("firing").hidden = firing.length === 0;
  document.getElementById("no-firing").hidden = firing.length !== 0;
  document.getElementById("no-firing").textContent = "Nothing firing.";
  fill(document.querySelector("#resolved tbody"), alertRows(resolved, a => ago(a.ends_at), members));
  document.getElementById("resolved-count").textContent =
    String(resolved.reduce((n, a) => n + (a.group ? a.count : 1), 0));
}

// ---- runs list --------------------------------------------------------------------------------

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

function plural(n, one, many) {
  return `${n.toLocaleString("en-US")} ${n === 1 ? one : (many || one + "s")}`;
}

function percent(ratio) {
  return ratio === null || ratio === undefined ? "-" : `${(100 * ratio).toFixed(ratio < 0.01 ? 2 : 1)}%`;
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

function eventKey(e) {
  return `${e.rank}/${e.incarnation}/${e.id}`;
}

// The run's newest events, each storm already collapsed into one row by the collector.
async function fetchNewest(run) {
  const body = await getJSON(`v1/runs/${encodeURIComponent(run)}/events/latest?limit=${MAX_EVENTS_SHOWN}`);
  return body.rows || [];
}

function eventDetails(e) {
  const cell = el("td", {});
  switch (e.kind) {
    case "skip":
    case "poisoned_step": {
      const names = (e.params || []).map(p => `${p.name} (inf ${p.inf}, nan ${p.nan})`);
      if (e.kind === "skip") cell.append(`streak ${e.streak}`, names.length ? " · " : "");
      else cell.append(`${POISON_REASONS[e.reason] || "poisoned"} (${e.reason})`, names.length ? " · " : "");
      if (names.length) cell.append(el("span", {class: "params"}, names.join(", ")));
      if (e.params_total && e.params_total > names.length) cell.append(` … ${e.params_total} parameters in all`);
      if (e.inspected === false) cell.append(" (not inspected: naming is rate-limited)");
      if (e.origin) {
        // This rank's own gradients held the inf/NaN before DDP's all-reduce spread it (agents before the
        // per-parameter notes named DDP buckets).
        const local = (e.origin_params || []).join(", ");
        const buckets = (e.origin_buckets || []).length ? `DDP bucket ${e.origin_buckets.join(", ")}: ` : "";
        cell.append(" · ", el("span", {class: "streak"}, "started on this rank"),
          local || buckets ? ` (${buckets}${local ? "own gradients " + local : ""})` : "");
      }
      if (e.calibration) cell.append(" · ", el("span", {class: "muted"}, "calibration (the scaler settling)"));
      if (e.began) cell.append(" · ", el("span", {class: "began"}, beganText(e.began, e.origin)));
      if (e.samples) cell.append(" · ", el("span", {class: "samples"}, samplesText(e.samples)));
      if (e.samples_before && e.samples_before.length) {
        // A streak's first event: the samples of the iterations before it, oldest first.
        cell.append(" · ", el("span", {class: "samples-before"}, "before: " + e.samples_before.map(
          b => `it ${b.iteration}: ${samplesText(b.samples, SAMPLE_IDS_BEFORE).replace(/^samples /, "")}`).join("; ")));
      }
      break;
    }
    case "scale_change":
      cell.append(`${e.cause}${e.count > 1 ? ` ×${e.count}` : ""}: ${scaleText(e.before)} → ${scaleText(e.after)}`);
      break;
    case "streak_end": cell.append(`streak of ${e.length} from iteration ${e.start_iteration} ended`); break;
    case "scheduler_after_skip": cell.append(`scheduler ${e.scheduler} stepped after a skip`); break;
    case "warning": cell.append(`${e.code}: ${e.message}`); break;
    case "scaler_disabled": cell.append("GradScaler(enabled=False): nothing skips; every step is checked"); break;
    case "loss_spike":
    case "grad_norm_spike": spikeDetails(e, cell); break;
    case "gradient_outlier":
      cell.append(`own gradient norm ${signal(e.value)}, the other ranks' ${signal(e.reference)} (spread ` +
                  `${signal(e.spread)}${e.z === null ? "" : `, z ${signal(e.z)}`}, ${plural(e.ranks_compared, "rank")} ` +
                  "compared): this rank's gradients stood out before DDP's all-reduce");
      break;
    case "close": cell.append("closed cleanly"); break;
    default: cell.append("");
  }
  return cell;
}

// A spike's row: its value against the window before it (how many deviations above its mean), and its samples.
function spikeDetails(e, cell) {
  const z = e.z === null || e.z === undefined ? "non-finite" : `z ${signal(e.z)}`;
  const window = e.mean === null || e.mean === undefined ? "window empty"
    : `window mean ${signal(e.mean)}, std ${signal(e.std)}`;
  cell.append(`value ${signal(e.value)} · ${z} · ${window}`);
  if (e.streak > 1) cell.append(" · ", el("span", {class: "streak"}, `spike ${e.streak} in a row`));
  if (e.local) cell.append(" · own gradients, before DDP's all-reduce");
  if (e.samples) cell.append(" · ", el("span", {class: "samples"}, samplesText(e.samples)));
}

// A spike's value, mean, z...: 4 significant digits ("NaN" and "Infinity" as sent).
function signal(v) {
  return typeof v === "number" ? String(Number(v.toPrecision(4))) : String(v);
}

// Where this rank's inf/NaN began (the event's began): the stage, then the module, its type and the parameter.
// A rank whose own gradients were finite (origin false, with ddp=) got the inf/NaN through DDP's all-reduce.
function beganText(b, origin) {
  const where = b.module !== null && b.module !== undefined
    ? ` in ${b.module || "the model"}${b.module_type ? ` (${b.module_type})` : ""}` : "";
  if (b.stage === "backward") {
    if (origin === false && !b.param && !where) return "began on another rank (this rank's loss and own gradients were finite)";
    return `began in backward${where}${b.param ? `, at ${b.param}` : ""}`;
  }
  if (b.stage === "forward") {
    const probe = {armed: ": the loss was not finite; the forward probes name the module next time",
                   found: ": after the model's modules (their outputs were finite: in the loss function)",
                   unavailable: ": the loss was not finite (no forward probes on this model)"}[b.probe] || "";
    return `began in forward${where}${where ? "" : probe}`;
  }
  return b.loss_finite === false ? "the loss was not finite" : "where it began is unknown";
}

// The iteration's samples: the first ids and how many.
const SAMPLE_IDS_SHOWN = 8;
const SAMPLE_IDS_BEFORE = 4;  // per iteration before a streak
function samplesText(s, shown = SAMPLE_IDS_SHOWN) {
  const ids = (s.ids || []).slice(0, shown).map(String);
  const more = s.count > ids.length ? ` … ${s.count} in all` : "";
  return `samples ${ids.join(", ")}${more}`;
}

// ---- suspects (GET /v1/suspects) --------------------------------------------------------------------

function runsText(runs) {
  return runs.length > 3 ? `${runs.slice(0, 3).join(", ")} … ${runs.length} runs` : runs.join(", ");
}

function deviceRow(d) {
  const ranks = d.ranks.map(r => `${r.run}/${r.rank}`);
  return el("tr", {class: "suspect-device", "data-device": d.device},
    el("td", {}, d.device),
    el("td", {}, `${d.host} local rank ${d.local_rank}${d.pci_bus_id ? ` (${d.pci_bus_id})` : ""}`),
    el("td", {class: "num"}, String(d.events)),
    el("td", {}, runsText(d.runs)),
    el("td", {}, ranks.length > 4 ? `${ranks.slice(0, 4).join(", ")} … ${ranks.length}` : ranks.join(", ")),
    el("td", {}, d.evidence.slice(-3).map(e => `it ${e.iteration}: ${samplesText(e.samples)}`).join("; ")),
    el("td", {}, ago(d.last)));
}

function sampleRow(s) {
  const its = s.iterations.map(i => `${i.run}/${i.iteration}`);
  return el("tr", {class: "suspect-sample", "data-sample": String(s.id)},
    el("td", {}, String(s.id)),
    el("td", {}, s.devices.join(", ")),
    el("td", {class: "num"}, String(s.events)),
    el("td", {}, runsText(s.runs)),
    el("td", {}, its.length > 6 ? `${its.slice(0, 6).join(", ")} … ${its.length}` : its.join(", ")));
}

async function refreshSuspects() {
  let body;
  try {
    body = await getJSON("v1/suspects");
  } catch (error) {
    if (error instanceof NeedsToken) throw error;
    document.getElementById("no-suspects").textContent = "Suspects are not available on this collector.";
    return;
  }
  fill(document.querySelector("#suspect-devices tbody"), body.devices.map(deviceRow));
  fill(document.querySelector("#suspect-samples tbody"), body.samples.map(sampleRow));
  document.getElementById("suspect-devices").hidden = body.devices.length === 0;
  document.getElementById("suspect-samples").hidden = body.samples.length === 0;
  document.getElementById("no-suspects").hidden = body.devices.length + body.samples.length !== 0;
}

// The run's loss scale on a log2 axis over the chosen window (GET /v1/runs/{run}/scale): a band from the
// lowest to the highest rank's scale, the median rank's line, and the outlier ranks' own lines; red dots mark
// their skipped steps. The caption sits in a strip above the plot and the ranks' labels in a column right of
// it, so no text ever lies on a line (the plot area holds only the band, the lines and the marks).
function drawChart(container, body, spikes = []) {
  const spread = body && body.spread;
  const lines = (body && body.outliers || []).map(o => ({rank: o.rank, asked: o.asked, skips: o.skips || [],
    streaks: o.streaks || [],
    points: o.points.map(([x, y]) => [x, scaleNumber(y)]), now: scaleNumber(o.loss_scale)}));
  for (const line of lines) {
    line.label = `rank ${line.rank}` + (onLogAxis(line.now) ? "" : ` (scale ${scaleText(line.now)}, off the axis)`);
  }
  const CHAR_PX = 6.5;  // wide enough for the 11px labels: a label too long runs off the chart's edge, not onto a line
  const W = 900, L = 56, T = 24, B = 28, LEGEND_ROW = 14;
  const R = lines.length ? Math.min(280, 16 + CHAR_PX * Math.max(...lines.map(line => line.label.length))) : 12;
  const H = Math.max(260, T + LEGEND_ROW * lines.length + B);
  const root = svg("svg", {viewBox: `0 0 ${W} ${H}`, role: "img",
    "aria-label": "loss scale over iterations: spread across ranks and outlier ranks"});
  let minY = Infinity, maxY = -Infinity;
  const note = y => { if (onLogAxis(y)) { minY = Math.min(minY, Math.log2(y)); maxY = Math.max(maxY, Math.log2(y)); } };
  if (spread) for (const k of ["min", "max"]) spread[k].forEach(v => note(scaleNumber(v)));
  for (const line of lines) for (const [, y] of line.points) note(y);
  if (!spread || minY === Infinity) {
    const why = spread ? "the loss scale is 0, NaN or infinite: nothing to draw on a log axis"
                       : "no loss scale reported yet";
    root.append(svg("text", {x: W / 2, y: H / 2, "text-anchor": "middle"}, why));
    container.replaceChildren(root);
    return;
  }
  minY = Math.floor(minY) - 1;
  maxY = Math.ceil(maxY) + 1;
  const x0 = body.start, x1 = Math.max(body.end, body.start + 1);
  const px = x => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const py = y => T + (1 - (Math.log2(y) - minY) / (maxY - minY)) * (H - T - B);
  const step = Math.max(1, Math.ceil((maxY - minY) / 8));
  for (let e = minY; e <= maxY; e += step) {
    const y = py(2 ** e);
    root.append(svg("line", {x1: L, x2: W - R, y1: y, y2: y, stroke: "#eef1f4"}));
    root.append(svg("text", {x: L - 6, y: y + 4, "text-anchor": "end"}, `2^${e}`));
  }
  // The x-axis starts where the window starts: recent history fills the chart.
  root.append(svg("text", {x: L, y: H - 8, class: "axis-start"}, `iteration ${x0}`));
  root.append(svg("text", {x: W - R, y: H - 8, "text-anchor": "end", class: "axis-end"}, `iteration ${body.end}`));
  // The band: each slice spans [its first iteration, the next slice's); gaps where no rank is on the axis.
  const its = spread.iteration, lows = spread.min.map(scaleNumber), highs = spread.max.map(scaleNumber);
  const edge = i => i + 1 < its.length ? its[i + 1] : body.end;
  let top = [], bottom = [];
  const closeBand = () => {
    if (top.length) root.append(svg("path", {class: "spread-band",
      d: "M" + top.concat(bottom.reverse()).map(([x, y]) => `${x.toFixed(1)},${y.toFixed(1)}`).join("L") + "Z"}));
    top = []; bottom = [];
  };
  its.forEach((x, i) => {
    if (!onLogAxis(lows[i]) || !onLogAxis(highs[i])) { closeBand(); return; }
    top.push([px(x), py(highs[i])], [px(edge(i)), py(highs[i])]);
    bottom.push([px(x), py(lows[i])], [px(edge(i)), py(lows[i])]);
  });
  closeBand();
  const medians = spread.median.map(scaleNumber);
  root.append(svg("path", {class: "spread-median", d: stepPath(its.map((x, i) => [x, medians[i]]), body.end, px, py)}));
  lines.forEach((line, i) => {
    const color = PALETTE[i % PALETTE.length];
    const d = stepPath(line.points, null, px, py);
    if (d) {
      const path = svg("path", {d, class: "scale-line", "data-rank": line.rank});
      path.style.stroke = color;  // CSSOM, not a style attribute: allowed by the page's CSP
      root.append(path);
    }
    const legend = svg("text", {x: W - R + 10, y: T + 8 + LEGEND_ROW * i, class: "legend", "data-rank": line.rank},
                       line.label);
    legend.style.fill = color;
    root.append(legend);
  });
  root.append(svg("text", {x: L, y: T - 9, class: "spread-key"},
    `shaded: lowest to highest of ${plural(body.ranks, "rank")} · dashed: median`));
  // Skips: a dot on a drawn rank's line at each skip the agent sent (a streak's 1st, 2nd, 4th, ... skip: the scale
  // then in force), and a stroke along the line over a whole streak once its end arrived (the skips in between are
  // counted, not sent).
  const scaleAt = (points, iteration) => {
    let scale = points[0][1];
    for (const [x, y] of points) { if (x <= iteration) scale = y; else break; }
    return scale;
  };
  for (const line of lines) {
    for (const [start, length, optimizer] of line.streaks) {
      const last = start + length - 1;
      if (last < x0) continue;
      const first = Math.max(start, x0);
      const [from, to] = [scaleAt(line.points, first), scaleAt(line.points, last)];
      if (!onLogAxis(from) || !onLogAxis(to)) continue;
      const stroke = svg("line", {x1: px(first), y1: py(from), x2: px(last), y2: py(to), stroke: "#c62828",
                                  "stroke-width": 3, "stroke-opacity": 0.5, class: "skip-streak"});
      stroke.append(svg("title", {}, `rank ${line.rank}: ${optimizer} skipped ${length} steps in a row from ` +
                                    `iteration ${start}`));
      root.append(stroke);
    }
    for (const [iteration, optimizer] of line.skips) {
      if (iteration < x0) continue;
      const scale = scaleAt(line.points, iteration);
      if (!onLogAxis(scale)) continue;
      const dot = svg("circle", {cx: px(iteration), cy: py(scale), r: 3.5, fill: "#c62828", class: "skip-mark"});
      dot.append(svg("title", {}, `rank ${line.rank} skipped ${optimizer} at iteration ${iteration}`));
      root.append(dot);
    }
  }
  // Spikes and gradient outliers: a mark just above the rank's line (the median's, for a rank not drawn) at the
  // iteration, one per kind, iteration and line, however many ranks share it (a whole-job spike).
  const drawn = new Map(lines.map(line => [line.rank, line]));
  const median = its.map((x, i) => [x, medians[i]]);
  const marks = new Map();
  for (const e of spikes) {
    if (e.iteration < x0 || e.iteration > body.end) continue;
    const line = drawn.get(e.rank);
    const scale = scaleAt(line ? line.points : median, e.iteration);
    if (!onLogAxis(scale)) continue;
    const key = `${e.kind}/${e.iteration}/${line ? e.rank : "median"}`;
    const mark = marks.get(key) || {e, scale, ranks: new Set()};
    mark.ranks.add(e.rank);
    marks.set(key, mark);
  }
  for (const {e, scale, ranks} of marks.values()) {
    const [x, y] = [px(e.iteration), py(scale) - 9];
    const shape = SPIKE_MARKS[e.kind](x, y);
    shape.setAttribute("class", "spike-mark");
    for (const [name, value] of [["kind", e.kind], ["iteration", e.iteration], ["ranks", [...ranks].join(",")]]) {
      shape.setAttribute(`data-${name}`, String(value));
    }
    const who = ranks.size === 1 ? `rank ${e.rank}` : `${ranks.size} ranks`;
    const what = e.kind === "gradient_outlier" ? `own gradient norm ${signal(e.value)} against the others' ` +
      `${signal(e.reference)}` : `value ${signal(e.value)}${e.z === null ? "" : `, z ${signal(e.z)}`}`;
    shape.append(svg("title", {}, `${who}: ${SPIKE_WORDS[e.kind]}${e.optimizer ? ` of ${e.optimizer}` : ""} at ` +
                                  `iteration ${e.iteration} (${ranks.size === 1 ? what : "latest: " + what})`));
    root.append(shape);
  }
  if (marks.size) {
    root.append(svg("text", {x: (L + W - R) / 2, y: H - 8, "text-anchor": "middle", class: "spike-key"},
      "▲ loss spike · ◆ gradient-norm spike · ○ gradient outlier"));
  }
  container.replaceChildren(root);
}

const SPIKE_WORDS = {loss_spike: "loss spike", grad_norm_spike: "gradient-norm spike",
                     gradient_outlier: "gradient outlier"};
// Each kind's mark, centred on (x, y): a triangle, a diamond, a ring.
const SPIKE_MARKS = {
  loss_spike: (x, y) => svg("path", {d: `M${x},${y - 5}L${x + 5},${y + 4}L${x - 5},${y + 4}Z`, fill: "#b36b00"}),
  grad_norm_spike: (x, y) => svg("path", {d: `M${x},${y - 5}L${x + 5},${y}L${x},${y + 5}L${x - 5},${y}Z`,
                                          fill: "#6a1b9a"}),
  gradient_outlier: (x, y) => svg("circle", {cx: x, cy: y, r: 5, fill: "none", stroke: "#6a1b9a",
                                             "stroke-width": 2}),
};

// A step line through [iteration, scale] points (each scale holds until the next point, the last until
// ``end`` when given); it breaks where the scale leaves the log axis (0, NaN, infinite) and resumes after.
function stepPath(points, end, px, py) {
  let d = "", drawing = false;
  points.forEach(([x, y], i) => {
    if (!onLogAxis(y)) { drawing = false; return; }
    const until = i + 1 < points.length ? points[i + 1][0] : (end ?? x);
    d += `${drawing ? "L" : "M"}${px(x).toFixed(1)},${py(y).toFixed(1)}L${px(until).toFixed(1)},${py(y).toFixed(1)}`;
    drawing = true;
  });
  return d;
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

const RARE_KINDS = ["poisoned_step", "scheduler_after_skip", "rank_conflict", "gradient_outlier", "warning",
                    "scaler_disabled", "close"];
const SPIKE_KINDS = ["loss_spike", "grad_norm_spike"];  // their marks on the chart (the outliers' come with RARE_KINDS)
const SPIKES_MARKED = 500;  // the newest of each kind: a whole-job spike is one mark, its events many

// The newest events of the kinds a skip storm never floods, so they stay in the table however many skips came.
async function fetchRare(run) {
  const pages = await Promise.all(RARE_KINDS.map(kind =>
    getJSON(`v1/runs/${encodeURIComponent(run)}/events?kind=${kind}&newest_first=true&limit=${MAX_EVENTS_SHOWN}`)));
  return pages.flatMap(body => (body.events || []).map(e => ({event: e, count: 1, ranks: 1})));
}

// The newest spikes, for the chart's marks (their rows come with the newest events, a whole-job spike in one).
async function fetchSpikes(run) {
  const pages = await Promise.all(SPIKE_KINDS.map(kind =>
    getJSON(`v1/runs/${encodeURIComponent(run)}/events?kind=${kind}&newest_first=true&limit=${SPIKES_MARKED}`)));
  return pages.flatMap(body => body.events || []);
}

// Newest first: one row per event, one per storm (the collector grouped its events: count, ranks).
function eventRows(rows) {
  return rows.map(({event: e, count, ranks, rank_ranges: ranges}) => {
    if (count === 1) {
      return el("tr", {class: "event", "data-kind": e.kind},
        el("td", {}, clock(e.time)), el("td", {class: "num"}, e.rank), el("td", {class: "num"}, e.iteration),
        el("td", {}, e.kind), el("td", {}, e.optimizer ?? ""), eventDetails(e));
    }
    const details = eventDetails(e);
    details.prepend(`${count} events, ranks ${ranges}; latest: `);
    return el("tr", {class: "event storm", "data-kind": e.kind},
      el("td", {}, clock(e.time)), el("td", {}, `${ranks} ranks`),
      el("td", {class: "num"}, e.iteration), el("td", {}, e.kind), el("td", {}, e.optimizer ?? ""), details);
  });
}

const RARE_SHOWN = 20;  // rows kept for the newest rare events, however many newer storm or skip rows there are

function rowKey(row) {
  const e = row.event;
  return row.count === 1 ? eventKey(e) : `storm/${e.kind}/${e.iteration}/${e.optimizer}/${e.cause}`;
}

function newestFirst(a, b) {
  return b.event.time - a.event.time || b.event.id - a.event.id;
}

async function drawRunHistory(run, summary) {
  const [scale, newest, rare, spikes] = await Promise.all([fetchScale(run, summary), fetchNewest(run), fetchRare(run),
                                                           fetchSpikes(run)]);
  // The newest rare events (poisoned steps, scheduler-after-skip, warnings...) keep their rows: a rank that
  // skips every few steps or a storm cannot push them out of the table.
  const kept = rare.sort(newestFirst).slice(0, RARE_SHOWN);
  const keptKeys = new Set(kept.map(rowKey));
  const rest = newest.filter(row => !keptKeys.has(rowKey(row))).slice(0, MAX_EVENTS_SHOWN - kept.length);
  const rows = [...kept, ...rest].sort(newestFirst);
  const outliers = rare.map(row => row.event).filter(e => e.kind === "gradient_outlier");
  drawChart(document.getElementById("chart"), scale, [...spikes, ...outliers]);
  const shown = eventRows(rows);
  fill(document.querySelector("#events tbody"), shown);
  document.getElementById("no-events").hidden = shown.length !== 0;
}

// ---- loop -------------------------------------------------------------------------------------

let timer = null;

async function refresh() {
  clearTimeout(timer);
  const run = currentRun();
  document.getElementById("run-view").hidden = run === null;
  document.getElementById("run-events").hidden = run === null;
  const banner = document.getElementById("error");
  try {
    // A run's ranks in trouble first: the rest is asked for once they are drawn, so that on a collector busy
    // with a whole-job storm these requests do not queue beside the summary's.
    const summary = run === null ? null : await refreshTrouble(run);
    await Promise.all([refreshAlerts(), refreshSuspects(), refreshRuns(),
                       run === null ? null : refreshRun(run, summary), refreshBlocks(run)]);
    banner.hidden = true;
    document.getElementById("refreshed").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (error) {
    if (error instanceof NeedsToken) {  // no refresh until the token is given
      banner.hidden = true;
      askForToken(error.message === "wrong");
      document.body.dataset.loaded = "true";
      return;
    }
    banner.textContent = `Cannot reach the collector (${error.message}); retrying.`;
    banner.hidden = false;
  }
  document.body.dataset.loaded = "true";
  timer = setTimeout(refresh, REFRESH_MS);
}

window.addEventListener("hashchange", refresh);
document.getElementById("all-ranks").addEventListener("toggle", () => {
  const run = currentRun();
  if (run === null || !document.body.dataset.loaded) return;
  allRanksChosen.add(run);
  refresh();
});
for (const button of document.querySelectorAll("#scale-window button")) {
  button.addEventListener("click", () => {
    scaleWindow = button.dataset.window;
    for (const other of document.querySelectorAll("#scale-window button")) {
      other.setAttribute("aria-pressed", String(other === button));
    }
    if (currentRun() !== null) refresh();
  });
}
document.getElementById("more-runs").addEventListener("click", () => {
  runPagesShown += 1;
  refresh();
});
document.getElementById("trouble-search").addEventListener("input", () => {
  const run = currentRun();
  if (run !== null) refreshTrouble(run);
});
refresh();
