// The studio's page: plain JavaScript and SVG, no build step. Every panel reads the same text: the
// prompt and its continuation from the Talk panel (`text.tokens`), as token ids the server gave.
"use strict";

const $ = (id) => document.getElementById(id);
const text = { tokens: [], prompt: 0 };  // tokens: {id, label, text, prob, alternatives}; prompt: how many are the prompt's
let info = null;
let controller = null;  // aborts the generation under way

// ---- the server ---------------------------------------------------------------------------------

async function post(path, body) {
  const response = await fetch(path, {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  });
  const data = await response.json();
  if (!response.ok) throw new Error(data.error ? data.error.message : response.statusText);
  return data;
}

// Server-sent events from a POST (EventSource only does GET): each event is "event: NAME\ndata: JSON\n\n".
async function events(path, body, signal, onEvent) {
  const response = await fetch(path, {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body), signal,
  });
  if (!response.ok) {
    const data = await response.json();
    throw new Error(data.error ? data.error.message : response.statusText);
  }
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const name = (block.match(/^event: (.*)$/m) || [])[1] || "message";
      const data = (block.match(/^data: (.*)$/m) || [])[1];
      if (data !== undefined) onEvent(name, JSON.parse(data));
    }
  }
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children) node.append(child);
  return node;
}

function svg(tag, attrs = {}) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  return node;
}

function fill(select, count) {
  select.replaceChildren(...Array.from({ length: count }, (_, i) => el("option", { value: i }, String(i))));
}

const percent = (p) => (100 * p).toFixed(p < 0.001 ? 3 : 1) + "%";
const ids = () => text.tokens.map((t) => t.id);

// ---- tabs ---------------------------------------------------------------------------------------

const panels = { talk: null, attention: showAttention, lens: showLens, walk: showWalk, copies: null, history: showHistory };

function openPanel(name) {
  for (const button of document.querySelectorAll("#tabs button")) button.classList.toggle("active", button.dataset.panel === name);
  for (const panel of document.querySelectorAll(".panel")) panel.hidden = panel.id !== "panel-" + name;
  if (panels[name]) panels[name]().catch(showError(name));
}

function showError(name) {
  return (err) => $("panel-" + name).prepend(el("p", { class: "error" }, String(err.message || err)));
}

// ---- talk ---------------------------------------------------------------------------------------

function number(id) {
  const value = $(id).value.trim();
  return value === "" ? null : Number(value);
}

async function generate() {
  controller = new AbortController();
  $("generate").disabled = true;
  $("stop").disabled = false;
  $("alternatives").hidden = true;
  $("talk-status").textContent = "";
  $("output").replaceChildren();
  text.tokens = [];
  const body = {
    prompt: $("prompt").value, max_new_tokens: number("max-new-tokens"), temperature: number("temperature"),
    top_k: number("top-k"), top_p: number("top-p"), seed: number("seed"),
  };
  try {
    await events("/api/generate", body, controller.signal, onTalkEvent);
  } catch (err) {
    if (err.name !== "AbortError") $("talk-status").replaceChildren(el("span", { class: "error" }, err.message));
  } finally {
    $("generate").disabled = false;
    $("stop").disabled = true;
  }
}

function onTalkEvent(name, data) {
  if (name === "prompt") {
    text.prompt = data.tokens.length;
    for (const [id, label] of data.tokens) addToken({ id, label, text: null });
  } else if (name === "token") {
    addToken(data);
  } else if (name === "done") {
    $("talk-status").textContent =
      `${data.tokens} tokens in ${data.seconds.toFixed(2)} s (${data.tokens_per_second.toFixed(1)} tokens/s), ended by ${data.finish_reason === "stop" ? "<|endoftext|>" : "the length asked for"}`;
  } else if (name === "error") {
    $("talk-status").replaceChildren(el("span", { class: "error" }, data.message));
  }
}

function addToken(token) {
  const index = text.tokens.length;
  text.tokens.push(token);
  const prompt = token.text === null;
  // a token that holds only part of a character shows a dot: the character comes whole with the token that completes it
  const shown = prompt ? token.label.replaceAll("\u2423", " ").replaceAll("\\n", "\n") : token.text || "\u00b7";
  const kind = prompt ? "token prompt" : token.text ? "token" : "token partial";
  const span = el("span", { class: kind, "data-index": index, title: token.label }, shown);
  if (!prompt) span.addEventListener("click", () => showAlternatives(index));
  $("output").append(span);
}

function showAlternatives(index) {
  const token = text.tokens[index];
  for (const span of document.querySelectorAll("#output .token")) span.classList.toggle("selected", Number(span.dataset.index) === index);
  const rows = [[token.id, token.label, token.prob, true], ...token.alternatives.map(([id, label, p]) => [id, label, p, false])];
  rows.sort((a, b) => b[2] - a[2]);
  const top = rows[0][2] || 1;
  const list = rows.map(([id, label, p, chosen]) =>
    el("div", { class: chosen ? "alt chosen" : "alt", "data-token": id },
      el("span", {}, label + (chosen ? "  (chosen)" : "")),
      el("div", { class: "bar", style: `width:${(100 * p / top).toFixed(1)}%` }),
      el("span", { class: "prob" }, percent(p))));
  const box = $("alternatives");
  box.replaceChildren(el("p", {}, `token ${index - text.prompt + 1} of the continuation: "${token.label}" had probability ${percent(token.prob)}; the ten the model liked best besides it:`), ...list);
  box.hidden = false;
}

// ---- attention ----------------------------------------------------------------------------------

function needText(panel) {
  if (text.tokens.length) return false;
  $(panel).replaceChildren(el("p", { class: "hint" }, "Generate some text in the Talk panel first."));
  return true;
}

async function showAttention() {
  if (needText("heatmap")) return;
  const layer = Number($("attention-layer").value || 0);
  const head = Number($("attention-head").value || 0);
  const data = await post("/api/attention", { ids: ids(), layer, head });
  drawHeatmap(data.weights, data.labels);
  drawHeads(data, layer);
}

// Up to this many tokens the heatmap is an SVG, a rectangle a cell with its labels; above it, one canvas
// a pixel a cell (GPT-2's 1,024 tokens would be a million SVG elements, more than a browser draws smoothly).
const SVG_MOST_TOKENS = 96;

function drawHeatmap(weights, labels) {
  if (labels.length > SVG_MOST_TOKENS) return drawHeatmapCanvas(weights, labels);
  const T = labels.length, cell = Math.max(6, Math.min(22, Math.floor(640 / T))), margin = 70;
  const size = margin + T * cell;
  const picture = svg("svg", { width: size, height: size, "data-rows": T, "data-cols": T });
  for (let q = 0; q < T; q++) {
    for (let k = 0; k < T; k++) {
      const w = weights[q][k];
      const rect = svg("rect", {
        x: margin + k * cell, y: margin + q * cell, width: cell, height: cell, class: "cell",
        fill: `rgba(25, 80, 200, ${w.toFixed(4)})`, stroke: "#eee", "stroke-width": 0.5, "data-weight": w,
      });
      const tip = svg("title");
      tip.textContent = `${labels[q]} → ${labels[k]}: ${w.toFixed(4)}`;
      rect.append(tip);
      rect.addEventListener("mouseenter", () => { $("attention-hover").textContent = tip.textContent; });
      picture.append(rect);
    }
  }
  if (cell >= 10) {
    labels.forEach((label, i) => {
      const row = svg("text", { x: margin - 4, y: margin + i * cell + cell * 0.75, "text-anchor": "end", "font-size": Math.min(12, cell - 2) });
      row.textContent = label.slice(0, 8);
      const col = svg("text", { transform: `translate(${margin + i * cell + cell * 0.75},${margin - 4}) rotate(-60)`, "font-size": Math.min(12, cell - 2) });
      col.textContent = label.slice(0, 8);
      picture.append(row, col);
    });
  }
  $("heatmap").replaceChildren(picture);
}

function drawHeatmapCanvas(weights, labels) {
  const T = labels.length, scale = Math.max(1, Math.floor(768 / T));
  const canvas = paintedWeights(weights, T * scale, { class: "cells", "data-rows": T, "data-cols": T });
  canvas.addEventListener("mousemove", (event) => {
    const box = canvas.getBoundingClientRect();
    const q = Math.floor(((event.clientY - box.top) / box.height) * T);
    const k = Math.floor(((event.clientX - box.left) / box.width) * T);
    if (q < 0 || k < 0 || q >= T || k >= T) return;
    $("attention-hover").textContent = `${labels[q]} → ${labels[k]}: ${weights[q][k].toFixed(4)}`;
  });
  $("heatmap").replaceChildren(el("p", { class: "hint" }, `${T} tokens: one pixel a cell (scaled ${scale}x); hover for the weight.`), canvas);
}

function paintedWeights(weights, size, attributes = {}) {
  // a (T, T) weights picture on a canvas, a pixel a cell, the same blue as the SVG's cells over white,
  // shown size x size pixels (cells enlarged as squares, or the picture shrunk)
  const T = weights.length, sharp = size >= T ? "image-rendering:pixelated" : "";
  const canvas = el("canvas", { ...attributes, width: T, height: T, style: `width:${size}px;height:${size}px;${sharp}` });
  const context = canvas.getContext("2d");
  const image = context.createImageData(T, T);
  for (let q = 0; q < T; q++) for (let k = 0; k < T; k++) {
    const at = 4 * (q * T + k), w = weights[q][k];
    image.data.set([255 - 230 * w, 255 - 175 * w, 255 - 55 * w, 255], at);
  }
  context.putImageData(image, 0, 0);
  return canvas;
}

function drawHeads(data, layer) {
  const S = data.heads[0].length, size = S * Math.max(1, Math.floor(96 / S));  // S: at most 96 cells a side
  const heads = data.heads.map((weights, h) => {
    const canvas = paintedWeights(weights, size);
    const score = data.scores[layer][h];
    const kind = score.kind ? el("span", { class: "kind" }, score.kind) : "";
    const scores = `prev ${score.previous.toFixed(2)} · first ${score.first.toFixed(2)}` +
      (score.induction === null ? "" : ` · induction ${score.induction.toFixed(2)}`);
    return el("div", { class: "head", "data-head": h, onclick: () => { $("attention-head").value = h; showAttention(); } },
      canvas, el("div", {}, `head ${h} `, kind), el("div", { class: "hint" }, scores));
  });
  $("head-grid").replaceChildren(...heads);
}

// ---- logit lens ---------------------------------------------------------------------------------

async function showLens() {
  if (needText("lens")) return;
  const data = await post("/api/lens", { ids: ids() });
  const layers = data.top.length;
  const header = el("tr", {}, el("th", {}, "after"), ...data.labels.map((label) => el("th", {}, label)));
  const rows = data.top.map((positions, layer) => el("tr", {},
    el("th", {}, layer === 0 ? "embeddings" : layer === layers - 1 ? `layer ${layer - 1} (final)` : `layer ${layer - 1}`),
    ...positions.map(([[, label, p], ...others], position) => el("td", {
      class: data.first_layer[position] === layer ? "first" : "",
      style: `background: rgba(40, 160, 90, ${p.toFixed(3)})`,
      title: [[0, label, p], ...others].map(([, l, q]) => `${l} ${percent(q)}`).join("\n"),
    }, label))));
  $("lens").replaceChildren(el("table", {}, header, ...rows));
}

// ---- walk-through -------------------------------------------------------------------------------

async function showWalk() {
  if (needText("walk")) return;
  const body = { ids: ids(), layer: Number($("walk-layer").value || 0), head: Number($("walk-head").value || 0) };
  const report = await post("/api/explain", body);
  const steps = report.steps.map((step) => {
    const extra = Object.entries(step).filter(([key]) => !["name", "code", "shape", "meaning"].includes(key));
    return el("div", { class: "step", "data-step": step.name },
      el("div", {}, el("code", {}, step.code), " ", el("span", { class: "shape" }, "(" + step.shape.join(", ") + ")")),
      el("div", {}, step.meaning),
      ...extra.map(([key, value]) => stepValue(key, value, step)));
  });
  const checks = el("div", { class: "step" },
    el("div", {}, `the steps give the layer's own output to within ${report.layer_max_diff.toExponential(1)}; ` +
      `${report.per_head_linears} separate per-head projections give it to within ${report.per_head_max_diff.toExponential(1)}`),
    el("pre", {}, "KV cache: " + JSON.stringify(report.kv_cache)));
  $("walk").replaceChildren(...steps, checks);
}

// The causal mask as a grid, a softmax row as bars; any other value as it is.
function stepValue(key, value, step) {
  if (key === "mask") {
    const labels = step.mask_labels || [];
    const rows = value.map((row, q) => el("tr", {}, el("th", {}, labels[q] || ""),
      ...row.map((allowed) => el("td", { class: allowed ? "allowed" : "masked" }, allowed ? "1" : "0"))));
    return el("table", { class: "mask" }, el("tr", {}, el("th", {}), ...labels.map((l) => el("th", {}, l))), ...rows);
  }
  if (key === "row") {
    const labels = text.tokens.slice(-value.length).map((t) => t.label);
    return el("div", { class: "row" }, el("p", {}, `head ${step.head}, the last token's weights over the tokens it sees:`),
      ...value.map((w, k) => el("div", { class: "alt" }, el("span", {}, labels[k] || String(k)),
        el("div", { class: "bar", style: `width:${(100 * w).toFixed(1)}%` }), el("span", {}, w.toFixed(3)))));
  }
  if (key === "mask_labels" || key === "labels") return "";
  return el("pre", {}, `${key}: ${JSON.stringify(value)}`.slice(0, 2000));
}

// ---- what it copied -----------------------------------------------------------------------------

async function findCopies() {
  $("copies-list").replaceChildren();
  if (needText("copies-text")) return;
  const generated = text.tokens.slice(text.prompt);
  try {
    const data = await post("/api/copies", { ids: generated.map((t) => t.id), min_tokens: number("min-tokens") });
    const copied = new Set();
    data.spans.forEach((span) => { for (let i = span.start; i < span.end; i++) copied.add(i); });
    $("copies-text").replaceChildren(...generated.map((t, i) =>
      el("span", { class: copied.has(i) ? "token copied" : "token" }, t.text)));
    $("copies-status").textContent = data.spans.length
      ? `${data.spans.length} span(s) of at least ${data.min_tokens} tokens occur word for word in the training text (${data.source || "the run's data"}):`
      : `nothing of ${data.min_tokens} tokens or more occurs word for word in the training text.`;
    $("copies-list").replaceChildren(...data.spans.map((span) => el("li", {},
      `tokens ${span.start}–${span.end - 1}: "${generated.slice(span.start, span.end).map((t) => t.text).join("")}" — ${where(span)}`)));
  } catch (err) {
    $("copies-status").replaceChildren(el("span", { class: "error" }, err.message));
  }
}

function where(span) {
  const parts = [];
  if (span.file) {  // the run's own files: the file, and the line there (or the document in it, then its line)
    parts.push(span.documents_in_file === 1
      ? `${span.file}, line ${span.line_in_document}`
      : `${span.file}, document ${span.document_in_file + 1}, line ${span.line_in_document}`);
  } else {
    if (span.document !== undefined && span.document !== null) parts.push(`document ${span.document + 1}`);
    if (span.line !== undefined && span.line !== null) parts.push(`line ${span.line}`);
  }
  if (span.char_offset !== undefined && span.char_offset !== null) parts.push(`character ${span.char_offset} of the training text`);
  if (span.occurrences) parts.push(`${span.occurrences} time(s) in all`);
  return parts.join(", ");
}

// ---- how it learned -----------------------------------------------------------------------------

let history = null;

async function showHistory() {
  history = history || await (await fetch("/api/history")).json();
  drawCurves(history);
  const slider = $("sample-slider");
  const steps = [...new Set(history.samples.map((s) => s.step))];
  slider.max = Math.max(0, steps.length - 1);
  slider.value = slider.max;
  slider.oninput = () => showSamples(steps[Number(slider.value)]);
  if (steps.length) showSamples(steps[steps.length - 1]);
  else $("samples").replaceChildren(el("p", { class: "hint" }, "This run wrote no samples.md."));
}

function showSamples(step) {
  $("sample-step").textContent = `step ${step}`;
  $("samples").replaceChildren(...history.samples.filter((s) => s.step === step).map((s) => el("pre", {}, s.text)));
}

function drawCurves(data) {
  const points = [...data.train, ...data.val];
  if (!points.length) {
    $("curves").replaceChildren(el("p", { class: "hint" }, "This checkpoint holds no loss curve."));
    return;
  }
  const width = 720, height = 300, pad = 50;
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  const [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  const x = (v) => pad + (width - 2 * pad) * (x1 > x0 ? (v - x0) / (x1 - x0) : 0.5);
  const y = (v) => height - pad - (height - 2 * pad) * (y1 > y0 ? (v - y0) / (y1 - y0) : 0.5);
  const picture = svg("svg", { width, height });
  for (const [series, colour] of [["train", "#4c78a8"], ["val", "#e45756"]]) {
    if (!data[series].length) continue;
    picture.append(svg("polyline", {
      points: data[series].map((p) => `${x(p[0])},${y(p[1])}`).join(" "), fill: "none", stroke: colour, "stroke-width": 2, class: series,
    }));
  }
  const label = (content, attrs) => { const t = svg("text", attrs); t.textContent = content; picture.append(t); };
  label(`loss ${y1.toFixed(2)}`, { x: 4, y: pad });
  label(`${y0.toFixed(2)}`, { x: 4, y: height - pad });
  label(`tokens seen: ${x0.toLocaleString()} … ${x1.toLocaleString()}`, { x: pad, y: height - 12 });
  label("train", { x: width - 120, y: 20, fill: "#4c78a8" });
  label("validation", { x: width - 70, y: 20, fill: "#e45756" });
  $("curves").replaceChildren(picture);
}

// ---- start --------------------------------------------------------------------------------------

async function start() {
  info = await (await fetch("/api/info")).json();
  const c = info.config;
  $("model-info").textContent = `${info.model}: ${c.n_layer} layers, ${c.n_head} heads, ${c.n_embd} wide, ` +
    `context ${c.block_size}, vocabulary ${c.vocab_size}` + (info.step === null ? "" : `, step ${info.step}`);
  $("offline-note").hidden = !info.offline_corpus;
  for (const id of ["attention-layer", "walk-layer"]) fill($(id), c.n_layer);
  for (const id of ["attention-head", "walk-head"]) fill($(id), c.n_head);
  showCopiesState(info.copies);
}

// The copy index is built in the background the first time a run is opened: ask until it is ready.
function showCopiesState(copies) {
  $("find-copies").disabled = copies.state !== "ready";
  $("copies-status").textContent = copies.state === "ready" ? "" : copies.reason || "";
  $("copies-status").dataset.state = copies.state;
  if (copies.state === "building") {
    setTimeout(async () => showCopiesState((await (await fetch("/api/info")).json()).copies), 2000);
  }
}

for (const button of document.querySelectorAll("#tabs button")) button.addEventListener("click", () => openPanel(button.dataset.panel));
$("generate").addEventListener("click", generate);
$("stop").addEventListener("click", () => controller && controller.abort());
$("attention-layer").addEventListener("change", () => showAttention().catch(showError("attention")));
$("attention-head").addEventListener("change", () => showAttention().catch(showError("attention")));
$("walk-layer").addEventListener("change", () => showWalk().catch(showError("walk")));
$("walk-head").addEventListener("change", () => showWalk().catch(showError("walk")));
$("find-copies").addEventListener("click", findCopies);
start();
