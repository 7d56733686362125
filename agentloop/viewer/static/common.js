"use strict";
/*
 * agentloop trajectory viewer, the browser side (common.js, run.js, table.js, sample.js, main.js, loaded in that order). Plain ES2020: no dependencies, no build step.
 * Every answer comes through api(): from the JSON the static exporter inlined, or from the live JSON API.
 * Text from the data is only ever inserted as text (textContent, text nodes), never parsed as HTML.
 */

const POLL_INTERVAL_MS = 3000;
const DASH = "–";
const COLOUR_STORAGE_KEY = "agentloop-viewer-colour-mode";

const state = {
  run: null,              // the last api/run answer, normalised
  viewedStep: null,       // the step whose table (or group) is on screen
  table: null,            // {step, entries: [{sample, order, row}]} for the table on screen
  sort: { key: "sample", dir: 1 },
  colourMode: "none",    // read from localStorage at start (sample.js)
  shownTokens: null,      // tokens of the sample in #sample-view, kept to recolour without rebuilding
  charts: [],             // drawn charts, each with markSelected(step)
  metricsSignature: "",
  liveArrivals: [],       // steps that appeared while the page was open
};
let renderSeq = 0;        // bumped on every route change, so late answers for an older route are dropped
const stepCache = new Map(); // a step's table never changes once written, so good answers are kept

/* ---------- data access ---------- */

let staticData;           // undefined until looked up; null when the page talks to a server
let staticDataError = null;

function getStaticData() {
  if (staticData === undefined) {
    const script = document.getElementById("agentloop-data");
    staticData = null;
    if (script) {
      try { staticData = JSON.parse(script.textContent); } catch (err) {
        staticData = {}; // still a static page: every panel then says why it is empty
        staticDataError = `the data inlined in this page could not be read: ${err.message}`;
      }
    }
  }
  return staticData;
}

const isStaticMode = () => getStaticData() !== null;

// path: the URL path with a leading slash and URL-encoded segments, e.g. "/api/steps/3/groups/a%20b".
// Resolves to {ok: true, data} or {ok: false, error}; never rejects.
async function api(path) {
  const inlined = getStaticData();
  if (inlined !== null) {
    if (staticDataError) return { ok: false, error: staticDataError };
    const key = path.split("/").map(safeDecode).join("/"); // the export's keys are not URL-encoded
    return Object.prototype.hasOwnProperty.call(inlined, key)
      ? { ok: true, data: inlined[key] } : { ok: false, error: "not included in this export" };
  }
  let response;
  try { // relative URL (no leading slash) so that the viewer also works behind a path prefix
    response = await fetch(path.replace(/^\//, ""), { cache: "no-store", headers: { Accept: "application/json" } });
  } catch (err) {
    return { ok: false, error: `could not reach the viewer's server (${err.message})` };
  }
  let body = null;
  try { body = await response.json(); } catch { /* not JSON: said below */ }
  if (!response.ok) return { ok: false, error: describeHttpError(response, body) };
  return body === null ? { ok: false, error: "the server's answer is not JSON" } : { ok: true, data: body };
}

function describeHttpError(response, body) {
  const detail = body && body.detail;
  if (typeof detail === "string") return detail;
  if (Array.isArray(detail)) return detail.map((d) => (d && d.msg) || JSON.stringify(d)).join("; "); // FastAPI validation
  return `the server answered ${response.status} ${response.statusText}`.trim();
}

async function loadStep(step) {
  if (stepCache.has(step)) return stepCache.get(step);
  const answer = await api(`/api/steps/${step}`);
  if (answer.ok) stepCache.set(step, answer);
  return answer;
}

/* ---------- small helpers ---------- */

const $ = (id) => document.getElementById(id);

// Element builder: props are attributes, except class, text and on* (listeners); children are nodes or
// strings (appended as text); null children are skipped, so optional parts can be written inline.
function h(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  node.append(...children.filter((child) => child !== null && child !== undefined));
  return node;
}

function svg(tag, attrs = {}, text = null) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, String(value));
  if (text !== null) node.textContent = text;
  return node;
}

function fill(container, ...children) {
  container.replaceChildren(...children.filter((child) => child !== null && child !== undefined));
}

function showMessage(container, text, kind = "info") {
  fill(container, h("p", { class: `message ${kind}`, text }));
}

function safeDecode(text) {
  try { return decodeURIComponent(text); } catch { return text; }
}

const isNum = (v) => typeof v === "number" && Number.isFinite(v);
const isMissing = (v) => v === null || v === undefined;
const clamp01 = (v) => Math.min(1, Math.max(0, v));
const at = (array, i) => (Array.isArray(array) && isNum(array[i]) ? array[i] : null);
const listOf = (v) => (Array.isArray(v) ? v : []);
const mean = (values) => (values.length ? values.reduce((a, b) => a + b, 0) / values.length : null);
const range = (values) => [Math.min(...values), Math.max(...values)];
const truncate = (text, max) => (text.length > max ? `${text.slice(0, max - 1)}…` : text);

function fmtNumber(v) {
  if (!isNum(v)) return isMissing(v) ? DASH : String(v);
  if (Number.isInteger(v)) return String(v);
  return Math.abs(v) >= 1000 ? v.toFixed(0) : String(Number(v.toPrecision(3)));
}

function fmtSeconds(v) {
  if (!isNum(v)) return DASH;
  return v < 1 ? `${Math.round(v * 1000)} ms` : `${v.toFixed(2)} s`;
}

// Any JSON value as one line of text (strings as they are).
const fmtValue = (v) => (isMissing(v) ? DASH : typeof v === "string" ? v : JSON.stringify(v));

// Red (0) to green (1), light enough for dark text on top; all-equal values get a neutral grey.
function rewardColour(value, [min, max]) {
  if (!isNum(value)) return "";
  if (!(max > min)) return "hsl(210, 15%, 90%)";
  return `hsl(${Math.round(120 * clamp01((value - min) / (max - min)))}, 70%, 82%)`;
}

function rewardBadge(value, rewardRange) {
  const badge = h("span", { class: "reward", text: fmtNumber(value) });
  badge.style.backgroundColor = rewardColour(value, rewardRange);
  return badge;
}

const signClass = (v) => (isNum(v) && v > 0 ? "pos" : isNum(v) && v < 0 ? "neg" : "");

const href = {
  step: (step) => `#/step/${step}`,
  sample: (step, sample) => `#/step/${step}/sample/${sample}`,
  group: (step, uid) => `#/step/${step}/group/${encodeURIComponent(uid)}`,
};

