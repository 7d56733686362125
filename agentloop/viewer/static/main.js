"use strict";
/* agentloop trajectory viewer: routing (#/step/N[/sample/I | /group/UID]) and start-up. */

/* ---------- routing ---------- */

function parseRoute(hash) {
  const parts = hash.replace(/^#\/?/, "").split("/").filter(Boolean);
  if (!parts.length) return { view: "latest" };
  if (parts[0] !== "step" || !/^\d+$/.test(parts[1] || "")) return { view: "unknown" };
  const step = Number(parts[1]);
  if (parts.length === 2) return { view: "table", step };
  if (parts.length === 4 && parts[2] === "sample" && /^\d+$/.test(parts[3])) return { view: "sample", step, sample: Number(parts[3]) };
  if (parts.length === 4 && parts[2] === "group") return { view: "group", step, uid: safeDecode(parts[3]) };
  return { view: "unknown" };
}

function showPanels(view) {
  $("content").dataset.view = view;
  $("table-panel").hidden = view === "group";
  $("sample-view").hidden = view !== "sample";
  $("group-view").hidden = view !== "group";
}

function showStep(step) {
  state.viewedStep = step;
  updateStepSelect(state.run ? state.run.steps : []);
  updateNewStepsHint();
  state.charts.forEach((chart) => chart.markSelected(step));
  $("export-link").hidden = isStaticMode() || step === null;
  $("export-link").setAttribute("href", `export/${step}`);
}

async function renderRoute() {
  const seq = ++renderSeq;
  const route = parseRoute(location.hash);
  const steps = state.run ? state.run.steps : [];
  const step = route.view === "latest" ? (steps.length ? steps[steps.length - 1] : null) : route.step ?? null;
  showPanels(route.view === "sample" || route.view === "group" ? route.view : "table");
  showStep(step);
  if (route.view !== "sample") state.shownTokens = null;
  if (route.view === "unknown" || step === null) {
    state.table = null;
    const found = state.run ? `No rollout dumps found. ${state.run.found || ""}` : "the run could not be read (see above)";
    return setTableMessage(route.view === "unknown" ? `nothing to show at ${location.hash}: addresses look like #/step/3 or #/step/3/sample/0` : found, "error");
  }
  if (route.view === "group") return renderGroupView(step, route.uid, seq);
  await Promise.all([renderStepTable(step, seq), route.view === "sample" ? renderSampleView(step, route.sample, seq) : null]);
  if (seq === renderSeq) highlightRow(route.sample);
}

function reportUnexpected(err) {
  setTableMessage(`the viewer hit a bug: ${err && err.message}`, "error");
  console.error(err); // a bug should be loud; problems with the data are shown in the panels instead
}

/* ---------- start ---------- */

async function start() {
  state.colourMode = readStoredColourMode();
  buildTableHead();
  const body = $("sample-table").tBodies[0];
  body.addEventListener("click", openRowSample);
  body.addEventListener("keydown", (event) => { if (event.key === "Enter") openRowSample(event); });
  $("sample-filter").addEventListener("input", applySortAndFilter);
  $("finish-filter").addEventListener("change", applySortAndFilter);
  $("step-select").addEventListener("change", (event) => { location.hash = href.step(event.target.value); });
  window.addEventListener("hashchange", () => renderRoute().catch(reportUnexpected));

  const answer = await api("/api/run");
  if (answer.ok) applyRun(answer.data);
  else {
    $("run-found").textContent = `the run could not be read: ${answer.error}`;
    $("run-found").className = "message error";
  }
  await renderRoute();
  // the #/ view stays on the step it opened with: polling adds steps and curves but never re-routes
  if (isStaticMode()) setLiveStatus("static export");
  else if (answer.ok && answer.data.live === false) setLiveStatus("not live");
  else { setLiveStatus("live", "live"); setTimeout(pollRun, POLL_INTERVAL_MS); }
}

start().catch(reportUnexpected);
