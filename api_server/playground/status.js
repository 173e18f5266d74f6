// The local stack's load, a small chart per model: GET /v1/status every two seconds, the last five minutes kept.
"use strict";

const SAMPLES = 150;
const WIDTH = 300;
const HEIGHT = 80;
const SERIES = [
  ["waiting, high", (m) => m.waiting.high || 0, "#b3261e"],
  ["waiting, normal", (m) => m.waiting.normal || 0, "#1f6feb"],
  ["held", (m) => m.held, "#7d8590"],
  ["predicted wait (s)", (m) => m.predicted_start_seconds || 0, "#2da44e"],
];
const history = new Map();

function $(id) {
  return document.getElementById(id);
}

function svg(name, attributes) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", name);
  for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, value);
  return node;
}

function chart(samples) {
  const top = Math.max(1, ...samples.flatMap((sample) => sample.values));
  const graph = svg("svg", { viewBox: `0 0 ${WIDTH} ${HEIGHT}`, width: WIDTH, height: HEIGHT, role: "img" });
  SERIES.forEach(([, , color], index) => {
    const points = samples.map((sample, at) => {
      const x = (at / (SAMPLES - 1)) * WIDTH;
      const y = HEIGHT - (sample.values[index] / top) * (HEIGHT - 4);
      return `${x.toFixed(1)},${y.toFixed(1)}`;
    });
    graph.appendChild(svg("polyline", { points: points.join(" "), fill: "none", stroke: color, "stroke-width": 1.5 }));
  });
  return graph;
}

function card(model, samples) {
  const last = samples[samples.length - 1].model;
  const section = document.createElement("article");
  const title = document.createElement("h2");
  title.textContent = `${last.model} v${last.model_version}${last.admission ? " (admission on)" : ""}`;
  section.appendChild(title);
  section.appendChild(chart(samples));
  const legend = document.createElement("p");
  legend.className = "hint";
  legend.textContent = SERIES.map(([label, read]) => `${label}: ${read(last)}`).join(" · ") +
    ` · answered/s: ${last.answered_per_second} · workers: ${last.workers} · run: ${last.run_seconds ?? "-"} s`;
  section.appendChild(legend);
  return section;
}

async function poll() {
  const key = $("key").value.trim();
  if (!key) return;
  try {
    const response = await fetch("/v1/status", { headers: { Authorization: "Bearer " + key } });
    const body = await response.json();
    if (!response.ok) throw new Error(body.error ? body.error.message : response.statusText);
    $("error").textContent = "";
    for (const model of body.models) {
      const name = `${model.model}/${model.model_version}`;
      const samples = history.get(name) || [];
      samples.push({ model, values: SERIES.map(([, read]) => read(model)) });
      history.set(name, samples.slice(-SAMPLES));
    }
    const cards = [...history.entries()].sort().map(([name, samples]) => card(name, samples));
    $("models").replaceChildren(...cards);
  } catch (error) {
    $("error").textContent = String(error.message || error);
  }
}

setInterval(poll, 2000);
$("key").addEventListener("change", poll);
