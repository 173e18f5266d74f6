// The fleet as one table: a row per model and version, from GET /v1/status every two seconds, each with a sparkline
// of its last five minutes (what waits and what its workers hold, kept in this tab since it opened). Every number is
// the one GET /v1/status gave (shown to at most three decimals; the exact value in the cell's data-value); nothing
// is computed here, nothing is loaded from elsewhere.
"use strict";

const PERIOD_MS = 2000;
const SAMPLES = 150; // five minutes at one sample per period
const SPARK_WIDTH = 150;
const SPARK_HEIGHT = 28;
const KEY_STORAGE = "maas-api-key"; // the playground's: sessionStorage only, gone when the tab closes
// The table's number columns: each cell's data-field names the field of GET /v1/status it shows.
const COLUMNS = [
  ["waiting.high", (m) => m.waiting.high ?? 0],
  ["waiting.normal", (m) => m.waiting.normal ?? 0],
  ["held", (m) => m.held],
  ["workers", (m) => m.workers],
  ["answered_per_second", (m) => m.answered_per_second],
  ["predicted_start_seconds", (m) => m.predicted_start_seconds],
  ["run_seconds", (m) => m.run_seconds],
];
// The sparkline's lines: requests waiting (every priority) and held by the model's workers.
const LINES = [
  ["waiting", (m) => Object.values(m.waiting).reduce((sum, count) => sum + count, 0), "#1f6feb"],
  ["held", (m) => m.held, "#7d8590"],
];
const history = new Map(); // "model/version" -> the last SAMPLES samples, each one value per LINES entry

function $(id) {
  return document.getElementById(id);
}

function element(name, text, attributes = {}) {
  const node = document.createElement(name);
  if (text !== undefined) node.textContent = text;
  for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, value);
  return node;
}

function svg(name, attributes) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", name);
  for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, value);
  return node;
}

function shown(value) {
  return value === null || value === undefined ? "–" : String(Number(value.toFixed(3)));
}

function sparkline(samples) {
  const top = Math.max(1, ...samples.flat());
  const graph = svg("svg", {
    viewBox: `0 0 ${SPARK_WIDTH} ${SPARK_HEIGHT}`, width: SPARK_WIDTH, height: SPARK_HEIGHT, role: "img",
    class: "sparkline",
  });
  const peaks = LINES.map(([label], index) => `${label} up to ${Math.max(...samples.map((s) => s[index]))}`);
  const title = svg("title", {});
  title.textContent = `Last five minutes: ${peaks.join(", ")}`;
  graph.appendChild(title);
  // The zero line, so a row with nothing going on still shows its (flat) five minutes.
  graph.appendChild(svg("line", { x1: 0, y1: SPARK_HEIGHT - 1, x2: SPARK_WIDTH, y2: SPARK_HEIGHT - 1, class: "zero" }));
  LINES.forEach(([, , color], index) => {
    // The newest sample at the right edge; a page open less than five minutes fills the right part only.
    const points = samples.map((sample, at) => {
      const x = SPARK_WIDTH - ((samples.length - 1 - at) / (SAMPLES - 1)) * SPARK_WIDTH;
      const y = SPARK_HEIGHT - 1 - (sample[index] / top) * (SPARK_HEIGHT - 3);
      return `${x.toFixed(1)},${y.toFixed(1)}`;
    });
    if (points.length === 1) points.unshift(`${(SPARK_WIDTH - 2).toFixed(1)},${points[0].split(",")[1]}`);
    graph.appendChild(svg("polyline", { points: points.join(" "), fill: "none", stroke: color, "stroke-width": 1.5 }));
  });
  return graph;
}

function row(model, samples) {
  const tr = element("tr", undefined, { "data-model": model.model, "data-version": model.model_version });
  // Nothing waiting, held or answered lately: drawn quieter, so the models with traffic stand out.
  if (samples[samples.length - 1].every((value) => value === 0) && !model.answered_per_second) tr.className = "idle";
  const name = element("th", model.model, { scope: "row" });
  if (model.admission) name.appendChild(element("span", "admission", { class: "badge", title: "admission by predicted wait" }));
  tr.appendChild(name);
  tr.appendChild(element("td", model.model_version));
  for (const [field, read] of COLUMNS) {
    const value = read(model);
    tr.appendChild(element("td", shown(value), { class: "number", "data-field": field, "data-value": JSON.stringify(value) }));
  }
  const spark = element("td", undefined, { class: "spark" });
  spark.appendChild(sparkline(samples));
  tr.appendChild(spark);
  return tr;
}

async function poll() {
  const key = $("key").value.trim();
  if (!key) return;
  try {
    const response = await fetch("/v1/status", { headers: { Authorization: "Bearer " + key } });
    const body = await response.json();
    if (!response.ok) throw new Error(body.error ? body.error.message : response.statusText);
    $("error").textContent = "";
    const rows = [];
    const models = [...body.models].sort((a, b) =>
      a.model === b.model ? a.model_version.localeCompare(b.model_version) : a.model.localeCompare(b.model));
    for (const model of models) {
      const name = `${model.model}/${model.model_version}`;
      const samples = [...(history.get(name) || []), LINES.map(([, read]) => read(model))].slice(-SAMPLES);
      history.set(name, samples);
      rows.push(row(model, samples));
    }
    $("models").replaceChildren(...rows);
    $("updated").textContent = `Every two seconds from GET /v1/status; last at ${new Date().toLocaleTimeString()}.`;
  } catch (error) {
    $("error").textContent = String(error.message || error);
  }
}

$("key").value = sessionStorage.getItem(KEY_STORAGE) || "";
$("key").addEventListener("change", () => {
  sessionStorage.setItem(KEY_STORAGE, $("key").value.trim());
  poll();
});
setInterval(poll, PERIOD_MS);
poll();
