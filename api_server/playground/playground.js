// The playground: the public API from the browser. Nothing the API returns is ever inserted as HTML:
// every text goes through textContent, every image through an <img> whose src is a data: URL.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = "maas-api-key"; // sessionStorage only: gone when the tab closes
const FIELD_ERRORS = {
  "parameters.width": "size", "parameters.height": "size", "parameters.seed": "seed",
  "parameters.num_inference_steps": "steps", "parameters.negative_prompt": "negative",
  "instances": "count", "instances.0.prompt": "prompt", "instances.0.image": "image",
  "instances.0.mask": "mask",
};
let catalog = [];
let current = null; // {jobId, controller}
let lastRequest = null;

function headers(extra) {
  return Object.assign({ Authorization: "Bearer " + $("key").value.trim() }, extra || {});
}

function clearErrors() {
  document.querySelectorAll(".error").forEach((node) => { node.textContent = ""; });
}

function showError(error) {
  const field = error && error.field;
  const target = field && (FIELD_ERRORS[field] || (field.startsWith("instances") ? "prompt"
    : /^parameters\.(controls|image_prompts)\b/.test(field) ? "control" : null));
  const node = $((target || "form") + "-error");
  node.textContent = (error && error.message) || "request failed";
}

async function api(method, path, body) {
  const init = { method, headers: headers(body ? { "Content-Type": "application/json" } : {}) };
  if (body) init.body = JSON.stringify(body);
  const response = await fetch(path, init);
  const data = await response.json().catch(() => ({}));
  if (!response.ok) throw Object.assign(new Error("api"), { status: response.status, detail: data.error || {} });
  return { status: response.status, data };
}

// Lists still loading (the models, a model's control models): the form is aria-busy meanwhile. Loads overlap (the
// key's change event, a model chosen), each re-drawing its list when it lands; a reader (assistive technology, the
// browser tests) reads the lists once the form says they have settled.
let loading = 0;

async function whileLoading(work) {
  $("form").setAttribute("aria-busy", String(++loading > 0));
  try {
    return await work();
  } finally {
    $("form").setAttribute("aria-busy", String(--loading > 0));
  }
}

function loadModels() {
  return whileLoading(listModels);
}

async function listModels() {
  clearErrors();
  if (!$("key").value.trim()) return;
  try {
    catalog = (await api("GET", "/v1/models")).data.models;
  } catch (failure) {
    $("key-error").textContent = failure.detail ? failure.detail.message : "cannot reach the API";
    return;
  }
  const select = $("model");
  const chosen = select.value; // the key's change event can come again (on blur): the user's choice stays
  select.replaceChildren(...catalog.map((model) => new Option(model.name + " (" + describe(model) + ")", model.name)));
  const preferred = catalog.find((model) => model.name === chosen)
    || catalog.find((model) => model.name.startsWith("sd15-txt2img"));
  if (preferred) select.value = preferred.name;
  modelChanged();
}

// A flow names its stages' models in order (it is called like a model); a model, its family and task.
function describe(model) {
  if (model.kind === "flow" && model.stages) return "flow: " + model.stages.map((stage) => stage.model).join(" > ");
  return (model.family ? model.family + ", " : "") + model.task;
}

function modelChanged() {
  const model = catalog.find((entry) => entry.name === $("model").value);
  if (!model) return;
  $("steps").placeholder = String(model.defaults.num_inference_steps);
  $("size").placeholder = model.defaults.width + "x" + model.defaults.height;
  $("count").max = String(model.max_instances_per_request);
  // GET /v1/models says what an instance takes: an image (image-to-image, edit, inpaint) and a mask (inpaint),
  // painted over the uploaded image. An edit model's prompt is its instruction.
  const inputs = model.inputs || ["prompt"];
  $("image-label").hidden = !inputs.includes("image");
  $("mask-editor").hidden = !inputs.includes("mask") || !$("mask-image").naturalWidth;
  $("prompt-name").textContent = model.task === "edit" ? "Instruction" : "Prompt";
  // A model without classifier-free guidance (FLUX) refuses a negative prompt: the field is not offered.
  $("negative-label").hidden = model.guidance !== "cfg";
  if (model.guidance !== "cfg") $("negative").value = "";
  $("model-hint").textContent = "up to " + model.limits.max_width + "x" + model.limits.max_height
    + " (multiples of " + model.size_multiple + "), " + model.limits.max_inference_steps + " steps, "
    + model.max_instances_per_request + " images";
  loadControls(model);
}

// The control models registered for the model (GET /v1/models/{model}), when it takes any (GET /v1/models'
// control_kinds): a ControlNet goes in parameters.controls, an IP-Adapter's image in parameters.image_prompts. The
// models are listed again when the key's field loses focus: a control still registered stays chosen.
function loadControls(model) {
  return whileLoading(() => listControls(model));
}

async function listControls(model) {
  const select = $("control");
  if (!(model.control_kinds || []).length) {
    select.replaceChildren(new Option("none", ""));
    $("control-editor").hidden = true;
    return;
  }
  let registered = [];
  try {
    registered = (await api("GET", "/v1/models/" + encodeURIComponent(model.name))).data.controls || [];
  } catch (failure) {
    $("control-error").textContent = failure.detail ? failure.detail.message : "cannot list the control models";
    return;
  }
  if ($("model").value !== model.name) return; // another model was chosen meanwhile
  const chosen = select.value;
  select.replaceChildren(new Option("none", ""), ...registered.map((control) => {
    const option = new Option(control.name + " (" + control.kind + ")", control.name);
    option.dataset.kind = control.kind;
    return option;
  }));
  if (registered.some((control) => control.name === chosen)) select.value = chosen;
  $("control-editor").hidden = !registered.length;
}

function readImage(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(String(reader.result).split(",", 2)[1]);
    reader.onerror = () => reject(new Error("the image file cannot be read"));
    reader.readAsDataURL(file);
  });
}

// The mask is painted on a canvas of the input image's own size (the API wants them alike); a stroke is opaque
// there, shown translucent over the image (CSS), and sent as a PNG: white where painted (repaint), black elsewhere.
const painting = { down: false, last: null, painted: false };

async function imageChosen() {
  const file = $("image").files[0];
  $("mask-image").removeAttribute("src");
  $("mask-editor").hidden = true;
  if (!file) return;
  const source = "data:" + file.type + ";base64," + await readImage(file);
  $("mask-image").onload = () => {
    $("mask-canvas").width = $("mask-image").naturalWidth; // resizing a canvas clears it
    $("mask-canvas").height = $("mask-image").naturalHeight;
    painting.painted = false;
    modelChanged();
  };
  $("mask-image").onerror = () => { $("image-error").textContent = "the image cannot be shown"; };
  $("mask-image").src = source;
}

function canvasPoint(event) {
  const canvas = $("mask-canvas");
  const box = canvas.getBoundingClientRect();
  const scale = canvas.width / box.width;
  return { x: (event.clientX - box.left) * scale, y: (event.clientY - box.top) * scale, scale };
}

function paint(event) {
  if (!painting.down) return;
  const point = canvasPoint(event);
  const context = $("mask-canvas").getContext("2d");
  context.strokeStyle = context.fillStyle = "#ff2d55";
  context.lineCap = context.lineJoin = "round";
  context.lineWidth = Number($("brush").value) * point.scale;
  context.beginPath();
  const from = painting.last || point;
  context.moveTo(from.x, from.y);
  context.lineTo(point.x, point.y);
  context.stroke();
  painting.last = point;
  painting.painted = true;
}

function paintStart(event) {
  event.preventDefault();
  $("mask-canvas").setPointerCapture(event.pointerId);
  painting.down = true;
  painting.last = null;
  paint(event);
}

function paintEnd() {
  painting.down = false;
  painting.last = null;
}

function clearMask() {
  const canvas = $("mask-canvas");
  canvas.getContext("2d").clearRect(0, 0, canvas.width, canvas.height);
  painting.painted = false;
}

// The PNG the request sends: every pixel white (painted) or black, nothing in between.
function maskPng() {
  const source = $("mask-canvas");
  const pixels = source.getContext("2d").getImageData(0, 0, source.width, source.height);
  for (let at = 0; at < pixels.data.length; at += 4) {
    const value = pixels.data[at + 3] >= 128 ? 255 : 0;
    pixels.data.set([value, value, value, 255], at);
  }
  const out = document.createElement("canvas");
  out.width = source.width;
  out.height = source.height;
  out.getContext("2d").putImageData(pixels, 0, 0);
  return out.toDataURL("image/png").split(",", 2)[1];
}

function integer(id, errors) {
  const text = $(id).value.trim();
  if (text === "") return undefined;
  if (!/^\d+$/.test(text)) { errors[id] = "a whole number"; return undefined; }
  return Number(text);
}

async function buildRequest() {
  const errors = {};
  const parameters = {};
  const seed = integer("seed", errors);
  const steps = integer("steps", errors);
  const count = integer("count", errors) || 1;
  if (seed !== undefined) parameters.seed = seed;
  if (steps !== undefined) parameters.num_inference_steps = steps;
  const size = $("size").value.trim();
  if (size) {
    const match = /^(\d+)\s*[xX]\s*(\d+)$/.exec(size);
    if (match) { parameters.width = Number(match[1]); parameters.height = Number(match[2]); }
    else errors.size = "WIDTHxHEIGHT, e.g. 512x512";
  }
  if ($("negative").value.trim()) parameters.negative_prompt = $("negative").value;
  if (!$("prompt").value.trim()) errors.prompt = "a prompt is needed";
  const instance = { prompt: $("prompt").value };
  const file = $("image").files[0];
  if (file && !$("image-label").hidden) instance.image = await readImage(file);
  const model = catalog.find((entry) => entry.name === $("model").value);
  if (model && (model.inputs || []).includes("mask")) {
    if (!file) errors.image = "an inpaint model repaints an input image";
    else if (!painting.painted) errors.mask = "paint the area to repaint over the image";
    else instance.mask = maskPng();
  }
  const control = $("control").selectedOptions[0];
  if (control && control.value && !$("control-editor").hidden) {
    const image = $("control-image").files[0];
    const scale = Number($("control-scale").value);
    if (!image) errors.control = "choose the image " + control.value + " follows";
    else if (!$("control-scale").value.trim() || !Number.isFinite(scale)) errors.control = "a scale, e.g. 1.0";
    else {
      const entry = { name: control.value, image: await readImage(image), scale };
      parameters[control.dataset.kind === "ip_adapter" ? "image_prompts" : "controls"] = [entry];
    }
  }
  Object.entries(errors).forEach(([id, message]) => { $(id + "-error").textContent = message; });
  if (Object.keys(errors).length) return null;
  return { model: $("model").value, body: { instances: Array(count).fill(instance), parameters } };
}

function setRunning(running) {
  $("submit").disabled = running;
  $("cancel").disabled = !running;
}

async function submit(event) {
  if (event) event.preventDefault();
  clearErrors();
  sessionStorage.setItem(KEY_STORAGE, $("key").value.trim());
  const request = await buildRequest();
  if (!request) return;
  lastRequest = request;
  $("progress").value = 0;
  $("status").textContent = "submitting";
  $("results").replaceChildren();
  setRunning(true);
  try {
    const answer = await api("POST", "/v1/models/" + encodeURIComponent(request.model) + "/jobs", request.body);
    if (answer.status === 200) { // answered from the cache
      finish({ status: "succeeded", id: answer.data.request_id, result: answer.data }, request);
      return;
    }
    await follow(answer.data.id, request);
  } catch (failure) {
    showError(failure.detail || { message: String(failure.message || failure) });
    $("status").textContent = "";
    setRunning(false);
  }
}

// EventSource cannot send the Authorization header: the stream is read with fetch.
async function follow(jobId, request) {
  const controller = new AbortController();
  current = { jobId, controller };
  $("status").textContent = "queued";
  const response = await fetch("/v1/jobs/" + encodeURIComponent(jobId) + "/events",
                               { headers: headers(), signal: controller.signal });
  if (!response.ok) throw Object.assign(new Error("stream"), { detail: (await response.json()).error });
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const fields = {};
      frame.split("\n").forEach((line) => {
        const at = line.indexOf(": ");
        if (at > 0 && !line.startsWith(":")) fields[line.slice(0, at)] = line.slice(at + 2);
      });
      if (fields.event && fields.data) onEvent(fields.event, JSON.parse(fields.data), request);
    }
  }
  setRunning(false);
}

function onEvent(kind, job, request) {
  if (kind === "queued") { $("status").textContent = "queued"; return; }
  if (kind === "running" && job.progress) {
    $("progress").value = Math.round((100 * job.progress.step) / job.progress.total);
    // A flow's steps count all its stages'; the stage running is named.
    const stage = job.progress.stage ? " (stage " + job.progress.stage + ")" : "";
    $("status").textContent = "running: step " + job.progress.step + " of " + job.progress.total + stage;
    return;
  }
  finish(job, request);
}

function finish(job, request) {
  setRunning(false);
  current = null;
  if (job.status !== "succeeded") {
    $("status").textContent = job.status;
    if (job.error) showError(job.error);
    return;
  }
  $("progress").value = 100;
  $("status").textContent = "succeeded";
  const result = job.result;
  const timings = Object.entries(result.timings_ms || {}).map(([name, ms]) => name + " " + Math.round(ms) + " ms");
  const figures = result.predictions.map((prediction, index) => {
    const figure = document.createElement("figure");
    const image = document.createElement("img");
    image.alt = "generated image " + (index + 1);
    image.src = "data:image/png;base64," + prediction.image_b64; // an image, never markup
    const caption = document.createElement("figcaption");
    caption.textContent = request.body.instances[index].prompt + " | seed " + prediction.seed + " | "
      + prediction.width + "x" + prediction.height + " | " + timings.join(", ");
    const download = document.createElement("a");
    download.href = image.src;
    download.download = job.id + "-" + index + ".png";
    download.textContent = "download";
    caption.append(" ", download);
    figure.append(image, caption);
    return figure;
  });
  $("results").replaceChildren(...figures);
  $("rerun").disabled = false;
  $("rerun").dataset.seed = String(result.predictions[0].seed);
}

async function cancel() {
  if (!current) return;
  try {
    await api("DELETE", "/v1/jobs/" + encodeURIComponent(current.jobId));
  } catch (failure) {
    showError(failure.detail);
  }
}

async function loadBatches() {
  $("batches-error").textContent = "";
  if (!$("key").value.trim()) return;
  let listed;
  try {
    listed = (await api("GET", "/v1/batches?limit=20")).data.batches;
  } catch (failure) {
    $("batches-error").textContent = failure.detail ? failure.detail.message : "cannot reach the API";
    return;
  }
  const rows = listed.map((batch) => {
    const counts = batch.request_counts;
    const done = counts.succeeded + counts.failed + counts.cancelled + counts.expired;
    const cells = [batch.id, batch.status, done + "/" + counts.total, counts.succeeded, counts.failed, batch.created_at];
    const row = document.createElement("tr");
    row.dataset.batch = batch.id;
    for (const value of cells) {
      const cell = document.createElement("td");
      cell.textContent = String(value);
      row.appendChild(cell);
    }
    return row;
  });
  $("batches").tBodies[0].replaceChildren(...rows);
}

function rerun() {
  $("seed").value = $("rerun").dataset.seed || "";
  submit();
}

document.addEventListener("DOMContentLoaded", () => {
  $("key").value = sessionStorage.getItem(KEY_STORAGE) || "";
  $("key").addEventListener("change", () => { sessionStorage.setItem(KEY_STORAGE, $("key").value.trim()); loadModels(); loadBatches(); });
  $("batches-refresh").addEventListener("click", loadBatches);
  $("model").addEventListener("change", modelChanged);
  $("form").addEventListener("submit", submit);
  $("cancel").addEventListener("click", cancel);
  $("rerun").addEventListener("click", rerun);
  $("image").addEventListener("change", imageChosen);
  $("mask-canvas").addEventListener("pointerdown", paintStart);
  $("mask-canvas").addEventListener("pointermove", paint);
  $("mask-canvas").addEventListener("pointerup", paintEnd);
  $("mask-canvas").addEventListener("pointercancel", paintEnd);
  $("mask-clear").addEventListener("click", clearMask);
  loadModels();
  loadBatches();
});
