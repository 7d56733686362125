"use strict";
/* agentloop trajectory viewer: one sample context by context and turn by turn with token colouring, and one GRPO
 * group side by side. A sample's tokens run through all its segments' responses; each segment has its context (the
 * row's prompt for the first, a rewrite for the others: rewritten_by) and its turns, whose spans index the tokens. */

/* ---------- one sample ---------- */

async function renderSampleView(step, index, seq) {
  const view = $("sample-view");
  view.classList.add("loading"); // the previous sample stays on screen until the next one is here
  if (!view.firstChild) showMessage(view, `loading sample ${index} of step ${step}…`);
  const answer = await api(`/api/steps/${step}/samples/${index}`);
  if (seq !== renderSeq) return;
  view.classList.remove("loading");
  state.shownTokens = answer.ok ? validTokens(answer.data.tokens) : null;
  if (!answer.ok) return showMessage(view, `sample ${index} of step ${step}: ${answer.error}`, "error");
  const sample = answer.data;
  fill(view, buildSampleHeader(step, sample), buildRewardParts(sample.reward_parts), buildColourControls(state.shownTokens),
    buildSegments(sample, state.shownTokens), buildExtra(sample.extra));
  applyTokenColours();
  view.scrollTop = 0;
}

const validTokens = (tokens) => (tokens && Array.isArray(tokens.text) ? tokens : null);

function fact(label, value, className = "") {
  const content = value instanceof Node ? value : h("span", { text: fmtValue(value) });
  return h("span", { class: `fact ${className}` }, h("span", { class: "fact-label", text: label }), " ", content);
}

// "12 (3 failed)": the part in brackets only when it is known.
const withDetail = (value, detail, word) => (isNum(detail) ? `${fmtNumber(value)} (${fmtNumber(detail)} ${word})` : fmtNumber(value));

function buildSampleHeader(step, sample) {
  const cached = stepCache.get(step); // the reward is coloured as in its row when the step's table is known
  const rewardRange = stepRewardRange(cached ? listOf(cached.data.samples) : []);
  const truth = fmtValue(sample.ground_truth);
  return h("div", { class: "sample-header" },
    h("div", { class: "view-title" },
      h("h2", { text: `sample ${fmtNumber(sample.sample)} · step ${step}` }),
      h("a", { class: "close-link", href: href.step(step), title: "close the sample", text: "× close" })),
    h("div", { class: "facts" },
      fact("group", isMissing(sample.uid) ? fmtNumber(sample.group)
        : h("a", { class: "group-link", href: href.group(step, sample.uid), text: `${fmtNumber(sample.group)}: compare the group` })),
      fact("data source", sample.data_source),
      fact("agent", sample.agent_name),
      fact("index", sample.index),
      fact("reward", rewardBadge(sample.reward, rewardRange)),
      fact("advantage", h("span", { class: signClass(sample.advantage), text: fmtNumber(sample.advantage) })),
      fact("finish", sample.finish_reason),
      fact("turns", sample.num_turns),
      sample.num_segments > 1 ? fact("contexts", `${sample.num_segments} (rewritten ${sample.num_segments - 1}×)`) : null,
      fact("length", withDetail(sample.response_length, sample.model_tokens, "model")),
      fact("tool calls", withDetail(sample.tool_calls, sample.tool_errors, "failed")),
      fact("time", fmtSeconds(sample.generate_time_s)),
      fact("ground truth", h("span", { class: "mono", title: truth, text: truncate(truth, 200) }), "wide")));
}

function buildRewardParts(parts) {
  if (!parts || typeof parts !== "object") return null;
  const list = h("dl", { class: "reward-parts" });
  for (const [key, value] of Object.entries(parts)) list.append(h("dt", { text: key }), h("dd", { text: fmtValue(value) }));
  return h("div", { class: "reward-parts-box" }, h("span", { class: "fact-label", text: "reward parts" }), list);
}

// The first segment's context is the row's prompt (its chat messages when the dump has no text of it).
function buildPrompt(sample, segment, label = "prompt") {
  let text = segment ? segment.prompt_text : null;
  if (typeof text !== "string" && segment === listOf(sample.segments)[0] && Array.isArray(sample.prompt_messages)) {
    text = sample.prompt_messages.map((m) => `[${m.role}]\n${fmtValue(m.content)}`).join("\n\n");
  }
  if (typeof text !== "string") return null;
  return h("details", { class: "prompt" }, h("summary", { text: `${label} (${text.length} characters)` }), h("pre", { text }));
}

// Where a later segment's context came from: a context strategy's rewrite, or a loop's context that does not extend
// the one before.
const rewriteText = (segment, n, count) => `context ${n + 1} of ${count}: `
  + (isMissing(segment.rewritten_by) ? "a new context, not an extension of the last" : `rewritten by ${segment.rewritten_by}`);

// A one-segment sample reads as before (its prompt, then its turns); several are shown one after another, each
// after a marker saying what rewrote its context.
function buildSegments(sample, tokens) {
  const segments = listOf(sample.segments);
  if (segments.length <= 1) {
    let turns = listOf(segments[0] && segments[0].turns);
    if (!turns.length && tokens) turns = [{ role: "response", start: 0, end: tokens.text.length }]; // tokens without turns
    return h("div", { class: "segments" }, buildPrompt(sample, segments[0]), buildTurns(turns, tokens, 0));
  }
  let turnsBefore = 0;
  return h("div", { class: "segments" }, ...segments.map((segment, n) => {
    const turns = buildTurns(listOf(segment.turns), tokens, turnsBefore);
    turnsBefore += listOf(segment.turns).length;
    return h("section", { class: "segment", "data-segment": n, "data-rewritten-by": segment.rewritten_by },
      n ? h("div", { class: "segment-rewrite", text: rewriteText(segment, n, segments.length) })
        : h("div", { class: "segment-head", text: `context 1 of ${segments.length}: the row's prompt` }),
      buildPrompt(sample, segment, n ? "rewritten context" : "prompt"), turns);
  }));
}

function buildExtra(extra) {
  if (isMissing(extra) || (typeof extra === "object" && !Object.keys(extra).length)) return null;
  return h("details", { class: "extra" }, h("summary", { text: "extra fields" }), h("pre", { text: JSON.stringify(extra, null, 2) }));
}

// turnsBefore: how many turns the earlier segments have, so that turns are numbered through the sample.
function buildTurns(turns, tokens, turnsBefore) {
  return h("div", { class: "turns" }, turns.length ? null : h("p", { class: "message", text: "no turns" }),
    ...turns.map((turn, n) => buildTurn(turn, turnsBefore + n, tokens)));
}

function buildTurn(turn, n, tokens) {
  const role = turn.role || "unknown";
  const isModel = role === "assistant";
  const spanned = tokens && isNum(turn.start) && isNum(turn.end);
  let label = `${n + 1}. ${role}${spanned ? ` · tokens ${turn.start}–${turn.end - 1}` : ""}`;
  if (isNum(turn.reward) && turn.reward !== 0) label += ` · reward ${fmtNumber(turn.reward)}`; // its own, if it had one
  return h("div", { class: `turn ${isModel ? "turn-model" : "turn-obs"}`, "data-role": role },
    h("div", { class: "turn-label", text: label }),
    spanned ? buildTokenSpans(tokens, turn.start, turn.end, isModel) : h("pre", { class: "turn-text", text: turn.text ?? "" }),
    ...listOf(turn.tool_calls).map(buildToolCall));
}

function buildTokenSpans(tokens, start, end, roleIsModel) {
  const fragment = document.createDocumentFragment(); // one layout for the whole turn
  for (let i = Math.max(0, start); i < Math.min(end, tokens.text.length); i++) {
    const isModel = Array.isArray(tokens.mask) ? Boolean(tokens.mask[i]) : roleIsModel; // 1/0 or true/false
    const span = document.createElement("span");
    span.className = isModel ? "tok tok-model" : "tok tok-obs";
    span.dataset.i = i;
    span.textContent = tokens.text[i];
    span.title = tokenTitle(tokens, i, isModel);
    fragment.append(span);
  }
  return h("div", { class: "tokens" }, fragment);
}

function tokenTitle(tokens, i, isModel) {
  const rollout = at(tokens.rollout_log_probs, i), trainer = at(tokens.old_log_probs, i), advantage = at(tokens.advantages, i);
  const lines = [`token ${i} · ${isModel ? "model (trained on)" : "observation (not trained on)"}`, `text ${JSON.stringify(tokens.text[i])}`];
  if (rollout !== null) lines.push(`rollout log-prob ${fmtNumber(rollout)} (p ${fmtNumber(Math.exp(rollout))})`);
  if (trainer !== null) lines.push(`trainer log-prob ${fmtNumber(trainer)}`);
  if (rollout !== null && trainer !== null) lines.push(`gap ${fmtNumber(Math.abs(rollout - trainer))}`);
  if (advantage !== null) lines.push(`advantage ${fmtNumber(advantage)}`);
  if (isModel && tokenVersion(tokens, i) !== null) lines.push(`policy version ${tokenVersion(tokens, i)}`);
  return lines.join("\n");
}

function buildToolCall(call) {
  const failed = !isMissing(call.error);
  const asString = typeof call.arguments === "string";
  const latency = isNum(call.latency_s) ? `, ${fmtSeconds(call.latency_s)}` : "";
  const summary = `${call.name ?? "?"}(${truncate(asString ? call.arguments : JSON.stringify(call.arguments ?? {}), 140)})`
    + ` → ${failed ? `error ${fmtValue(call.error)}` : "ok"}${latency}`;
  return h("details", { class: `tool-call ${failed ? "failed" : "ok"}` }, h("summary", { text: summary }),
    h("div", { class: "tool-label", text: "arguments" }),
    h("pre", { text: asString ? call.arguments : JSON.stringify(call.arguments ?? {}, null, 2) }),
    h("div", { class: "tool-label", text: "result" }),
    h("pre", { class: "tool-result", text: fmtValue(call.result) }));
}

/* ---------- token colouring ---------- */

const tint = (rgb, strength) => (strength < 0.02 ? "" : `rgba(${rgb}, ${(0.8 * clamp01(strength)).toFixed(3)})`);

function tokenGap(tokens, i) {
  const rollout = at(tokens.rollout_log_probs, i), trainer = at(tokens.old_log_probs, i);
  return rollout === null || trainer === null ? null : Math.abs(rollout - trainer);
}

// A token's policy version (the weights that sampled it), or null: an observation token, or one of unknown version (-1).
const tokenVersion = (tokens, i) => { const v = at(tokens.policy_versions, i); return v !== null && v >= 0 ? v : null; };

// One colour per policy version, the same in every sample: hues a golden angle apart, so that versions next to each
// other (those one sample mixes) look far apart.
const versionColour = (version) => `hsl(${Math.round((version * 137.508) % 360)}, 75%, 76%)`;

function versionLegend(tokens) {
  const known = tokens.text.map((_, i) => tokenVersion(tokens, i)).filter((v) => v !== null);
  const versions = [...new Set(known)].sort((a, b) => a - b);
  const swatches = versions.map((v) => h("span",
    { class: "tok version-swatch", "data-version": v, text: `v${v}`, style: `background-color: ${versionColour(v)}` }));
  return ["policy version that sampled each model token: ", ...swatches.flatMap((swatch) => [swatch, " "]),
    versions.length ? "(uncoloured: unknown)" : "none known in this sample"];
}

// Per mode: the token arrays it needs, a model token's background (scaled so the usual range uses most
// of the tint) and how to read it (a text, or a function of the tokens giving the legend's parts).
const COLOUR_MODES = {
  none: { label: "no colouring", needs: [], colour: () => "", legend: "" },
  logprob: {
    label: "rollout log-prob", needs: ["rollout_log_probs"],
    colour: (t, i) => tint("235, 110, 0", -(at(t.rollout_log_probs, i) ?? 0) / 4),
    legend: "orange: low rollout log-prob (none at 0, full at −4 and below)",
  },
  gap: {
    label: "rollout − trainer log-prob gap", needs: ["rollout_log_probs", "old_log_probs"],
    colour: (t, i) => tint("140, 60, 220", Math.sqrt(tokenGap(t, i) ?? 0)),
    legend: "purple: |rollout − trainer| log-prob gap (faint at 0.01, full at 1 and above)",
  },
  advantage: {
    label: "advantage", needs: ["advantages"],
    colour: (t, i) => { const a = at(t.advantages, i) ?? 0; return tint(a >= 0 ? "30, 170, 60" : "220, 40, 40", Math.abs(a) / 2); },
    legend: "green: positive advantage, red: negative (full at ±2)",
  },
  version: {
    label: "policy version", needs: ["policy_versions"],
    colour: (t, i) => { const v = tokenVersion(t, i); return v === null ? "" : versionColour(v); },
    legend: versionLegend,
  },
};

const colourModeAvailable = (mode, tokens) => mode === "none" || (Boolean(tokens) && COLOUR_MODES[mode].needs.every((key) => Array.isArray(tokens[key])));

// The chosen mode is kept even when one sample lacks its data; that sample is then shown uncoloured.
const effectiveColourMode = (tokens) => (colourModeAvailable(state.colourMode, tokens) ? state.colourMode : "none");

function readStoredColourMode() {
  try {
    const stored = localStorage.getItem(COLOUR_STORAGE_KEY);
    return Object.prototype.hasOwnProperty.call(COLOUR_MODES, stored) ? stored : "none";
  } catch { return "none"; } // storage can be off (file:// policies, private windows)
}

function buildColourControls(tokens) {
  const select = h("select", { id: "colour-mode", "aria-label": "colour tokens by" },
    ...Object.entries(COLOUR_MODES).map(([mode, { label }]) => h("option", { value: mode, text: label, disabled: !colourModeAvailable(mode, tokens) })));
  select.value = effectiveColourMode(tokens);
  select.addEventListener("change", () => {
    state.colourMode = select.value;
    try { localStorage.setItem(COLOUR_STORAGE_KEY, select.value); } catch { /* kept for this page only */ }
    applyTokenColours();
  });
  return h("div", { class: "colour-controls" }, h("label", {}, "colour ", select),
    h("div", { class: "legend" }, h("span", { class: "tok tok-model", text: "model token (trained on)" }), " ",
      h("span", { class: "tok tok-obs", text: "observation token (not trained on)" }), " ", h("span", { id: "colour-legend", class: "muted" })),
    h("div", { class: "token-summary muted", text: tokens ? tokenSummary(tokens) : "no token data in this dump: the turns are shown as text" }));
}

// One line that points at a rollout/trainer mismatch before anyone hovers a token.
function tokenSummary(tokens) {
  const model = tokens.text.map((_, i) => i).filter((i) => !Array.isArray(tokens.mask) || Boolean(tokens.mask[i]));
  const parts = [`${model.length} model tokens of ${tokens.text.length}`];
  const logProbs = model.map((i) => at(tokens.rollout_log_probs, i)).filter(isNum);
  if (logProbs.length) parts.push(`mean rollout log-prob ${fmtNumber(mean(logProbs))}`);
  const gaps = model.map((i) => [i, tokenGap(tokens, i)]).filter(([, gap]) => gap !== null);
  if (gaps.length) {
    const [worst, gap] = gaps.reduce((a, b) => (b[1] > a[1] ? b : a));
    parts.push(`mean gap ${fmtNumber(mean(gaps.map((g) => g[1])))}, largest ${fmtNumber(gap)} at token ${worst}`);
  }
  const versions = model.map((i) => tokenVersion(tokens, i)).filter((v) => v !== null);
  if (versions.length) {
    const [oldest, newest] = range(versions);
    parts.push(oldest === newest ? `policy version ${oldest}` : `policy versions ${oldest}–${newest}`);
  }
  return parts.join(" · ");
}

function applyTokenColours() {
  const tokens = state.shownTokens;
  const mode = COLOUR_MODES[effectiveColourMode(tokens)];
  if ($("colour-legend")) fill($("colour-legend"), ...(typeof mode.legend === "function" ? mode.legend(tokens) : [mode.legend]));
  // observation tokens are never tinted: they are not trained on, so their numbers are not the point
  for (const span of $("sample-view").querySelectorAll(".tok-model[data-i]")) span.style.backgroundColor = mode.colour(tokens, Number(span.dataset.i));
}

/* ---------- one GRPO group ---------- */

async function renderGroupView(step, uid, seq) {
  const view = $("group-view");
  showMessage(view, `loading group ${uid} of step ${step}…`);
  const answer = await api(`/api/steps/${step}/groups/${encodeURIComponent(uid)}`);
  if (seq !== renderSeq) return;
  if (!answer.ok) return fill(view, buildGroupTitle(step, uid), h("p", { class: "message error", text: `group ${uid}: ${answer.error}` }));
  const samples = listOf(answer.data.samples);
  const rewards = samples.map((s) => s.reward).filter(isNum);
  const rewardRange = stepRewardRange(samples);
  const first = samples[0] || {};
  fill(view, buildGroupTitle(step, uid),
    h("div", { class: "facts" },
      fact("samples", samples.length),
      fact("mean reward", fmtNumber(mean(rewards))),
      fact("rewards", rewards.length ? `${fmtNumber(rewardRange[0])} to ${fmtNumber(rewardRange[1])}` : DASH),
      fact("data source", first.data_source),
      fact("ground truth", truncate(fmtValue(first.ground_truth), 200), "wide")),
    buildPrompt(first, listOf(first.segments)[0]),
    h("div", { class: "group-columns" }, ...samples.map((sample) => buildGroupColumn(step, sample, rewardRange))));
}

function buildGroupTitle(step, uid) {
  return h("div", { class: "view-title" },
    h("h2", {}, `group of step ${step} `, h("span", { class: "mono small", text: uid })),
    h("a", { class: "close-link", href: href.step(step), text: `← step ${step} table` }));
}

function buildGroupColumn(step, sample, rewardRange) {
  const tokens = validTokens(sample.tokens);
  const summary = ` · ${fmtValue(sample.finish_reason)} · ${fmtNumber(sample.num_turns)} turns · ${fmtNumber(sample.response_length)} tokens`;
  let turnNumber = 0; // through all its segments
  return h("div", { class: "group-sample", "data-sample": sample.sample },
    h("a", { class: "group-sample-head", href: href.sample(step, sample.sample), title: "open this sample" },
      h("strong", { text: `#${fmtNumber(sample.sample)}` }), " ", rewardBadge(sample.reward, rewardRange),
      h("span", { class: signClass(sample.advantage), text: ` adv ${fmtNumber(sample.advantage)}` }), h("span", { class: "muted", text: summary })),
    ...listOf(sample.segments).flatMap((segment, n, segments) => [
      n ? h("div", { class: "segment-rewrite", text: rewriteText(segment, n, segments.length) }) : null,
      ...listOf(segment.turns).map((turn) => {
        const role = turn.role || "unknown";
        const text = typeof turn.text === "string" ? turn.text : tokens ? tokens.text.slice(turn.start, turn.end).join("") : "";
        return h("div", { class: `turn compact ${role === "assistant" ? "turn-model" : "turn-obs"}`, "data-role": role },
          h("div", { class: "turn-label", text: `${++turnNumber}. ${role}` }), h("pre", { class: "turn-text", text }),
          ...listOf(turn.tool_calls).map(buildToolCall));
      }),
    ]));
}

