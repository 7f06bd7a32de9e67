// ampwatch status page: what every part of the page shares (markup, the read token, reading the API, times
// and scales). The page's scripts are classic scripts loaded in the order index.html lists them, sharing one
// global scope, with no build step; app.js, last, runs the refresh loop.
// Every user-provided string (run ids, hosts, parameter names) goes through textContent or
// setAttribute, never as HTML, so nothing a rank sends can become markup.
"use strict";

const REFRESH_MS = 3000;
const MAX_EVENTS_SHOWN = 100;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
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

function plural(n, one, many) {
  return `${n.toLocaleString("en-US")} ${n === 1 ? one : (many || one + "s")}`;
}

function percent(ratio) {
  return ratio === null || ratio === undefined ? "-" : `${(100 * ratio).toFixed(ratio < 0.01 ? 2 : 1)}%`;
}
