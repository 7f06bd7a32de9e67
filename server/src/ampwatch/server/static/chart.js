// The status page's chart: a run's loss scale over iterations as SVG (GET /v1/runs/{run}/scale).
// User strings only ever go through textContent or setAttribute (page.js).
"use strict";

const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"];
const SVG = "http://www.w3.org/2000/svg";

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

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
