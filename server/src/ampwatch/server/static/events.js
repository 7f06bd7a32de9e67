// The status page's events of a run (GET /v1/runs/{run}/events, /events/latest), and the chart's marks.
// User strings only ever go through textContent or setAttribute (page.js).
"use strict";

// poisoned_step reasons (docs/protocol.md) in words.
const POISON_REASONS = {
  nonfinite_grad: "stepped with non-finite gradients",
  nonfinite_param: "parameters non-finite after the step",
};

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
