"use strict";
/* agentloop trajectory viewer: a step's sortable, filterable table of samples. */

/* ---------- step table ---------- */

const COLUMNS = [
  { key: "sample", label: "#", title: "sample" },
  { key: "group", label: "group", title: "GRPO group" },
  { key: "data_source", label: "source", title: "data source" },
  { key: "reward", label: "reward", title: "reward" },
  { key: "advantage", label: "adv.", title: "advantage" },
  { key: "finish_reason", label: "finish", title: "finish reason" },
  { key: "num_turns", label: "turns", title: "turns" },
  { key: "num_segments", label: "contexts", title: "contexts the trajectory was sampled under (segments; above 1: rewritten)" },
  { key: "response_length", label: "length", title: "response length (tokens)" },
  { key: "tool_calls", label: "tools", title: "tool calls" },
  { key: "tool_errors", label: "errors", title: "tool errors" },
  { key: "generate_time_s", label: "time", title: "generation time" },
];
const ALL_FINISH = "all";
const NO_FINISH = "(none)";

function buildTableHead() {
  const row = h("tr");
  for (const { key, label, title } of COLUMNS) {
    row.append(h("th", { "data-sort": key, scope: "col", title: `${title}: click to sort`, onclick: () => sortTableBy(key) }, label));
  }
  fill($("sample-table").tHead, row);
}

function sortTableBy(key) {
  state.sort = { key, dir: state.sort.key === key ? -state.sort.dir : 1 };
  applySortAndFilter();
}

function setTableMessage(text, kind = "info") {
  const message = $("table-message");
  message.textContent = text;
  message.className = `message ${kind}`;
  message.hidden = !text;
  $("table-filters").hidden = Boolean(text);
  $("table-scroll").hidden = Boolean(text);
}

async function renderStepTable(step, seq) {
  if (state.table && state.table.step === step) return; // already on screen: keep its scroll, sort and filter
  state.table = null;
  $("step-format").textContent = "";
  renderProblemList($("step-problems"), []);
  setTableMessage(`loading step ${step}…`);
  const answer = await loadStep(step);
  if (seq !== renderSeq) return;
  if (!answer.ok) return setTableMessage(`step ${step}: ${answer.error}`, "error");
  fillStepTable(step, answer.data);
  setTableMessage("");
}

function fillStepTable(step, data) {
  const samples = listOf(data.samples);
  const format = data.format || "unknown format";
  $("step-format").textContent = `step ${step} · ${samples.length} samples · ${format}`;
  $("step-format").classList.toggle("legacy", !format.startsWith("agentloop-rollouts"));
  renderProblemList($("step-problems"), listOf(data.problems));
  const rewardRange = stepRewardRange(samples);
  state.table = { step, entries: samples.map((sample, order) => ({ sample, order, row: buildSampleRow(step, sample, rewardRange) })) };
  fillFinishFilter(samples);
  applySortAndFilter();
}

function stepRewardRange(samples) {
  const rewards = samples.map((s) => s.reward).filter(isNum);
  return rewards.length ? range(rewards) : [0, 1];
}

function buildSampleRow(step, sample, rewardRange) {
  const row = h("tr", { class: "sample-row", "data-sample": sample.sample, tabindex: 0 });
  for (const { key } of COLUMNS) {
    const value = sample[key];
    const cell = h("td", { "data-key": key });
    if (key === "group") {
      cell.append(fmtNumber(value), " ");
      if (!isMissing(sample.uid)) cell.append(h("a", { class: "group-link", href: href.group(step, sample.uid), text: "group" }));
    } else if (key === "reward") cell.append(rewardBadge(value, rewardRange));
    else cell.textContent = key === "generate_time_s" ? fmtSeconds(value) : fmtNumber(value);
    if (key === "advantage") cell.className = signClass(value);
    if (key === "tool_errors" && value > 0) cell.className = "bad";
    row.append(cell);
  }
  return row;
}

function fillFinishFilter(samples) {
  const select = $("finish-filter");
  const previous = select.value;
  const reasons = [...new Set(samples.map((s) => String(s.finish_reason ?? NO_FINISH)))].sort();
  fill(select, ...[ALL_FINISH, ...reasons].map((reason) => h("option", { value: reason, text: reason })));
  select.value = reasons.includes(previous) ? previous : ALL_FINISH;
}

function matchesFilter(sample, text, finish) {
  if (finish !== ALL_FINISH && String(sample.finish_reason ?? NO_FINISH) !== finish) return false;
  return !text || [sample.data_source, sample.finish_reason, sample.agent_name, sample.index, sample.group]
    .some((field) => !isMissing(field) && String(field).toLowerCase().includes(text));
}

// Nulls always sort last, whichever the direction; ties keep the dump's order.
function compareEntries(key, dir) {
  return (a, b) => {
    const va = a.sample[key], vb = b.sample[key];
    if (isMissing(va) || isMissing(vb)) return isMissing(va) === isMissing(vb) ? a.order - b.order : isMissing(va) ? 1 : -1;
    const order = typeof va === "number" && typeof vb === "number" ? va - vb
      : String(va).localeCompare(String(vb), undefined, { numeric: true });
    return order * dir || a.order - b.order;
  };
}

// Rows are built once per step; sorting and filtering only reorder and hide them.
function applySortAndFilter() {
  if (!state.table) return;
  const text = $("sample-filter").value.trim().toLowerCase();
  const finish = $("finish-filter").value;
  const fragment = document.createDocumentFragment();
  let shown = 0;
  for (const entry of [...state.table.entries].sort(compareEntries(state.sort.key, state.sort.dir))) {
    entry.row.hidden = !matchesFilter(entry.sample, text, finish);
    shown += entry.row.hidden ? 0 : 1;
    fragment.append(entry.row);
  }
  fill($("sample-table").tBodies[0], fragment);
  $("sample-count").textContent = `showing ${shown} of ${state.table.entries.length} samples`;
  for (const th of $("sample-table").tHead.querySelectorAll("th")) {
    const sorted = th.dataset.sort === state.sort.key;
    th.classList.toggle("sorted-asc", sorted && state.sort.dir === 1);
    th.classList.toggle("sorted-desc", sorted && state.sort.dir === -1);
  }
}

function highlightRow(sampleIndex) {
  for (const row of $("sample-table").tBodies[0].rows) row.classList.toggle("selected", row.dataset.sample === String(sampleIndex));
}

function openRowSample(event) {
  if (event.target.closest("a")) return; // the group link navigates by itself
  const row = event.target.closest("tr.sample-row");
  if (row && state.table) location.hash = href.sample(state.table.step, row.dataset.sample);
}

