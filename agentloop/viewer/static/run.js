"use strict";
/* agentloop trajectory viewer: the run's header, problems, step selector, live polling and curves. */

/* ---------- run header, problems, step selector, polling ---------- */

function normaliseRun(run) {
  const steps = listOf(run.steps).filter(isNum).sort((a, b) => a - b);
  return { ...run, steps, problems: listOf(run.problems), metrics: listOf(run.metrics).filter((m) => m && isNum(m.step)) };
}

function renderRunHeader(run) {
  $("run-title").textContent = run.title || "agentloop run";
  $("run-found").textContent = run.found || "";
  $("run-found").className = "muted";
  $("run-path").textContent = run.path || "";
  document.title = `${run.title || "run"} · agentloop viewer`;
}

function setLiveStatus(text, kind = "") {
  $("live-status").textContent = text;
  $("live-status").className = `badge ${kind}`;
}

function renderProblemList(list, problems) {
  fill(list, ...problems.map((text) => h("li", { class: "problem", text: fmtValue(text) })));
  list.hidden = problems.length === 0;
}

function updateStepSelect(steps) {
  const select = $("step-select");
  const options = steps.length ? steps.map((step) => h("option", { value: step, text: `step ${step}` })) : [h("option", { text: "no steps" })];
  // rebuilt only when the steps change, so a poll never closes the list under the user's pointer
  if ([...select.options].map((o) => o.text).join() !== options.map((o) => o.text).join()) fill(select, ...options);
  select.disabled = steps.length === 0;
  if (state.viewedStep !== null) select.value = String(state.viewedStep);
}

// Newer steps that came in while someone reads are announced, never jumped to.
function updateNewStepsHint() {
  const newer = state.liveArrivals.filter((step) => state.viewedStep !== null && step > state.viewedStep);
  const button = $("new-steps");
  button.hidden = newer.length === 0;
  $("step-select").classList.toggle("has-new", newer.length > 0);
  if (newer.length) {
    const latest = Math.max(...newer);
    button.textContent = `${newer.length} new step${newer.length > 1 ? "s" : ""}: show step ${latest}`;
    button.onclick = () => { location.hash = href.step(latest); };
  }
}

function applyRun(run) {
  const before = state.run && state.run.steps;
  state.run = normaliseRun(run);
  renderRunHeader(state.run);
  renderProblemList($("problems"), state.run.problems);
  renderCurves(state.run.metrics);
  updateStepSelect(state.run.steps);
  if (!before) return;
  state.liveArrivals.push(...state.run.steps.filter((step) => !before.includes(step)));
  updateNewStepsHint();
  // a page that had no step to show has no view to keep: show the first ones as they come
  if (!before.length && state.run.steps.length && parseRoute(location.hash).view === "latest") renderRoute().catch(reportUnexpected);
}

async function pollRun() {
  const answer = await api("/api/run");
  if (answer.ok) {
    const firstAnswer = state.run === null; // the first load failed: now there is something to show
    applyRun(answer.data);
    if (firstAnswer) renderRoute().catch(reportUnexpected);
    setLiveStatus(`live · checked ${new Date().toLocaleTimeString()}`, "live");
  } else {
    setLiveStatus(`server not answering: ${answer.error}`, "error");
  }
  setTimeout(pollRun, POLL_INTERVAL_MS);
}

/* ---------- curves ---------- */

const CHARTS = [
  { title: "reward", series: [{ key: "critic/score/mean", label: "train" }, { key: "val/score/mean", label: "val", dots: true }] },
  { title: "response length", series: [{ key: "response_length/mean" }] },
  { title: "turns", series: [{ key: "num_turns/mean" }] },
  { title: "tool error rate", series: [{ key: "multi_turn/tool_error_rate" }] },
  { title: "entropy", series: [{ key: "actor/entropy" }] },
  { title: "KL", series: [{ key: "actor/approx_kl", label: "approx_kl" }, { key: "actor/ppo_kl", label: "ppo_kl" }, { key: "actor/kl_loss", label: "kl_loss" }] },
];
const CHART = { width: 240, height: 100, left: 40, right: 6, top: 6, bottom: 16 };

function renderCurves(metrics) {
  const signature = `${metrics.length}:${JSON.stringify(metrics[metrics.length - 1] || null)}`;
  if (signature === state.metricsSignature) return; // redrawing on every poll would drop the hover readout
  state.metricsSignature = signature;
  const xDomain = range(metrics.map((m) => m.step)); // shared, so that one step lines up across charts
  state.charts = CHARTS.map((def) => buildChart(def, metrics, xDomain)).filter(Boolean);
  fill($("curves"), ...state.charts.map((chart) => chart.node));
  $("curves").hidden = state.charts.length === 0;
  state.charts.forEach((chart) => chart.markSelected(state.viewedStep));
}

function buildChart(def, metrics, [x0, x1]) {
  const series = def.series.map((s) => ({ ...s, points: metrics.filter((m) => isNum(m[s.key])).map((m) => [m.step, m[s.key]]) }))
    .filter((s) => s.points.length);
  if (!series.length) return null;
  const { width, height, left, right, top, bottom } = CHART;
  let [y0, y1] = range(series.flatMap((s) => s.points.map((p) => p[1])));
  if (y0 === y1) { const pad = Math.abs(y0) * 0.1 || 1; y0 -= pad; y1 += pad; } // a flat line still needs a range
  const x = (step) => left + (x1 > x0 ? (step - x0) / (x1 - x0) : 0.5) * (width - left - right);
  const y = (v) => top + (1 - (v - y0) / (y1 - y0)) * (height - top - bottom);

  const plot = svg("svg", { viewBox: `0 0 ${width} ${height}`, class: "chart-svg", role: "img", "aria-label": def.title });
  plot.append(svg("path", { class: "axis", d: `M${left},${top} V${height - bottom} H${width - right}` }),
    svg("text", { x: left - 4, y: top + 8, "text-anchor": "end", class: "chart-label" }, fmtNumber(y1)),
    svg("text", { x: left - 4, y: height - bottom, "text-anchor": "end", class: "chart-label" }, fmtNumber(y0)),
    svg("text", { x: left, y: height - 3, class: "chart-label" }, `step ${x0}`),
    svg("text", { x: width - right, y: height - 3, "text-anchor": "end", class: "chart-label" }, String(x1)));
  const selected = svg("line", { class: "selected-step", y1: top, y2: height - bottom, visibility: "hidden" });
  plot.append(selected);
  series.forEach((s, n) => {
    const d = s.points.map(([sx, sy], i) => `${i ? "L" : "M"}${x(sx).toFixed(1)},${y(sy).toFixed(1)}`).join(" ");
    plot.append(svg("path", { class: `line series-${n}`, d }));
    if (s.dots || s.points.length === 1) {
      for (const [sx, sy] of s.points) plot.append(svg("circle", { class: `dot series-${n}`, cx: x(sx), cy: y(sy), r: 2.2 }));
    }
  });
  const hover = svg("line", { class: "hover-step", y1: top, y2: height - bottom, visibility: "hidden" });
  plot.append(hover);

  const readout = h("span", { class: "chart-readout" });
  const node = h("figure", { class: "chart", "data-metric": def.series[0].key },
    h("figcaption", {}, h("span", { class: "chart-title", text: def.title }), " ",
      ...series.map((s, n) => (s.label ? h("span", { class: `legend series-${n}`, text: s.label }) : null)), readout),
    plot);

  const lookup = series.map((s) => new Map(s.points));
  const chartSteps = [...new Set(series.flatMap((s) => s.points.map((p) => p[0])))].sort((a, b) => a - b);
  const describe = (step) => `step ${step}: ${series.map((s, n) => `${s.label ? `${s.label} ` : ""}${fmtNumber(lookup[n].get(step))}`).join(", ")}`;
  const moveLine = (line, step) => { line.setAttribute("x1", x(step)); line.setAttribute("x2", x(step)); };
  const stepAtPointer = (event) => { // the chart's step nearest to the pointer: no need to hit a 2-pixel point
    const box = plot.getBoundingClientRect();
    const px = ((event.clientX - box.left) / box.width) * width;
    return chartSteps.reduce((best, step) => (Math.abs(x(step) - px) < Math.abs(x(best) - px) ? step : best));
  };
  const hasRollouts = (step) => state.run.steps.includes(step);
  const rest = () => { readout.textContent = describe(chartSteps[chartSteps.length - 1]); hover.setAttribute("visibility", "hidden"); };
  plot.addEventListener("mousemove", (event) => {
    const step = stepAtPointer(event);
    readout.textContent = describe(step) + (hasRollouts(step) ? " · click to open" : "");
    moveLine(hover, step);
    hover.setAttribute("visibility", "visible");
    plot.classList.toggle("clickable", hasRollouts(step));
  });
  plot.addEventListener("mouseleave", rest);
  plot.addEventListener("click", (event) => {
    const step = stepAtPointer(event);
    if (hasRollouts(step)) location.hash = href.step(step);
  });
  rest();
  const markSelected = (step) => {
    const visible = isNum(step) && step >= x0 && step <= x1;
    selected.setAttribute("visibility", visible ? "visible" : "hidden");
    if (visible) moveLine(selected, step);
  };
  return { node, markSelected };
}

