// The status page's alerts: firing and recently resolved (GET /v1/alerts), a storm's alerts as one row.
// User strings only ever go through textContent or setAttribute (page.js).
"use strict";

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
