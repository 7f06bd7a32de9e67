// The status page's suspect devices and samples (GET /v1/suspects).
// User strings only ever go through textContent or setAttribute (page.js).
"use strict";

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
