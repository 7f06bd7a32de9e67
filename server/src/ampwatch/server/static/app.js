// The status page's refresh loop, run once every other script of the page (index.html) is loaded.
// User strings only ever go through textContent or setAttribute (page.js).
"use strict";

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
