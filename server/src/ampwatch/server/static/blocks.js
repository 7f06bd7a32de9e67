"use strict";
// A run split over several collectors (--peers, --block-ranks): the run view says which block this collector holds,
// "block i of n (ranks a-b)", and links to the other blocks' replicas' pages (GET /v1/runs/{run}/placement).
// Nothing shows with one collector, or for a run held whole here. Uses app.js's el() and getJSON().

function blockRanks(block) {
  return `ranks ${block.first_rank}-${block.last_rank}`;
}

function blocksLine(run, placement) {
  const parts = [];
  if (placement.split) {
    const mine = placement.blocks.filter(b => b.here);
    const numbers = mine.map(b => b.index + 1).join(", ");
    const ranges = mine.map(blockRanks).join(", ");
    parts.push(`block${mine.length > 1 ? "s" : ""} ${numbers || "none"} of ${placement.block_count}` +
               ` (${ranges || "no ranks"} of ${placement.world_size}) on this collector;` +
               " the whole run's view is Prometheus's. Other blocks:");
    for (const b of placement.blocks.filter(b => !b.here)) {
      const link = /^https?:\/\//.test(b.collector)
        ? el("a", {href: `${b.collector}/#run=${encodeURIComponent(run)}`, class: "block-link",
                   "data-block": String(b.index)}, `block ${b.index + 1} (${blockRanks(b)})`)
        : `block ${b.index + 1} (${blockRanks(b)})`;
      parts.push(" ", link);
    }
    const more = placement.block_count - placement.blocks.length;
    if (more > 0) parts.push(` and ${more} more`);
  }
  if (placement.misplaced_ranks) {
    parts.push(el("span", {class: "misplaced"}, ` ${placement.misplaced_ranks} rank(s) sent here belong to another ` +
                          "collector by --peers and --block-ranks: check the agents' AMPWATCH_URL and " +
                          "AMPWATCH_BLOCK_RANKS."));
  }
  return parts;
}

let oneCollector = false;  // no --peers: nothing to show, nothing more to ask

async function refreshBlocks(run) {
  const line = document.getElementById("run-blocks");
  let placement = null;
  if (run !== null && !oneCollector) {
    try {
      const body = await getJSON(`v1/runs/${encodeURIComponent(run)}/placement`);
      oneCollector = body.collectors === 1;
      placement = body.placement;
    } catch (error) {
      if (error instanceof NeedsToken) throw error;
    }
  }
  const parts = placement ? blocksLine(run, placement) : [];
  line.replaceChildren(...parts);
  line.hidden = parts.length === 0;
}
