// cloverq operator dashboard: polls the admin JSON endpoints and renders with plain DOM calls.
// No build step, no framework. Every server value goes through textContent (never innerHTML),
// so a tenant name or an error message cannot inject markup.
"use strict";

const KEY_STORAGE = "cloverq.adminKey";
const REFRESH_MS = 2000;
const STATUSES = ["queued", "running", "succeeded", "failed", "cancelled", "expired"];
const QUEUE_COLORS = { interactive: "#2f6fdb", standard: "#1f9d55", bulk: "#c08a1e", joint: "#8e44ad" };

const BATCH_SEGMENTS = ["succeeded", "failed", "cancelled", "expired", "running"];  // the progress bar, left to right

const state = {
  key: sessionStorage.getItem(KEY_STORAGE), selectedJob: null, selectedBatch: null, timer: null,
  jobsSignature: null, batchesSignature: null, batchSignature: null,
};

function $(id) { return document.getElementById(id); }

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null) continue;
    if (name === "class") node.className = value;
    else if (name === "style") node.setAttribute("style", value);
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function svg(tag, attrs, ...children) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, value);
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return node;
}

// Remembers the key a refused request was sent with: an answer to a request made before the
// user signed in again (the page's first keyless refresh, a mistyped key) must not sign out the
// key entered since.
class AuthError extends Error {
  constructor(message, key) { super(message); this.key = key; }
}

async function api(path) {
  const headers = { Accept: "application/json" };
  const key = state.key;
  if (key) headers.Authorization = "Bearer " + key;
  const response = await fetch(path, { headers });
  if (response.status === 401 || response.status === 403) {
    let message = "This key is not an admin key.";
    try { message = (await response.json()).error.message || message; } catch (_) { /* keep default */ }
    throw new AuthError(message, key);
  }
  if (!response.ok) throw new Error(path + " answered " + response.status);
  return response.json();
}

function fmtSeconds(s) {
  if (s === null || s === undefined) return "–";
  if (s < 1) return (s * 1000).toFixed(0) + " ms";
  if (s < 120) return s.toFixed(2) + " s";
  return (s / 60).toFixed(1) + " min";
}

// Metadata as short "key=value" pairs (a client's labels: a contract id, a document name).
function fmtMeta(meta) {
  if (!meta || typeof meta !== "object") return "–";
  const pairs = Object.entries(meta).map(([k, v]) => k + "=" + (typeof v === "object" ? JSON.stringify(v) : String(v)));
  return pairs.length ? pairs.join(", ") : "–";
}

function fmtBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return n.toFixed(i ? 1 : 0) + " " + units[i];
}

function fmtTime(iso) {
  if (!iso) return "–";
  return new Date(iso).toLocaleTimeString();
}

function modelLabel(name, version) {
  // Versions often already start with the model's name ("demo@0a71..."): do not repeat it.
  if (!version) return name || "?";
  if (!name || version.startsWith(name + "@")) return version;
  return name + "@" + version;
}

function badge(status) {
  return el("span", { class: "badge status-" + status, style: "--c: var(--" + status + ", #999)" }, status);
}

function replaceRows(tbody, rows) {
  tbody.replaceChildren(...rows);
}

// ---------------------------------------------------------------------------------------------
// Overview: status tiles, queues, workers

function renderOverview(data) {
  renderVersions(data);
  const tiles = STATUSES.map((s) =>
    el("div", { class: "tile", style: "--c: var(--" + s + ")", "data-status": s },
      el("div", { class: "n" }, data.counts.by_status[s] || 0),
      el("div", { class: "label" }, s)));
  $("status-tiles").replaceChildren(...tiles);

  const latency = data.latency || {};
  const rows = data.queues.map((q) => {
    const counts = data.counts.by_queue[q.name] || {};
    const lat = latency[q.name];
    const pair = (p) => (p ? fmtSeconds(p.p50) + " / " + fmtSeconds(p.p95) : "–");
    return el("tr", { "data-queue": q.name },
      el("td", {}, el("i", { class: "dot", style: "color:" + (QUEUE_COLORS[q.name] || "#999") }, "● "), q.name,
        q.drained ? el("b", { class: "drained", title: "drained: no worker takes from it (POST .../resume)" }, " drained") : ""),
      el("td", { class: "num" }, q.queued), el("td", { class: "num" }, q.running),
      el("td", { class: "num" }, counts.succeeded || 0), el("td", { class: "num" }, counts.failed || 0),
      el("td", { class: "num" }, q.workers_ready),
      el("td", { class: "num" }, lat ? pair(lat.wait) : "–"), el("td", { class: "num" }, lat ? pair(lat.run) : "–"));
  });
  replaceRows($("queues-table").tBodies[0], rows);
  $("throughput").textContent = data.throughput.finished_last_minute + " jobs finished in the last minute · "
    + data.throughput.tokens_per_second.toFixed(1) + " tokens/s across workers";

  const workers = data.workers.map((w) => el("tr", { "data-worker": w.worker },
    el("td", {}, w.worker), el("td", {}, w.state || "–"), el("td", {}, (w.queues || []).join(", ")),
    el("td", {}, modelLabel(w.model_name, w.model_version)),
    el("td", { class: "num" }, (w.tokens_per_second || 0).toFixed(1)),
    el("td", { class: "num" }, Math.round((w.batch_occupancy || 0) * 100) + "%"),
    el("td", { class: "num" }, fmtBytes(w.memory_used_bytes) + " / " + fmtBytes(w.memory_total_bytes))));
  if (!workers.length) workers.push(el("tr", {}, el("td", { colspan: 7, class: "muted" }, "no worker is publishing")));
  replaceRows($("workers-table").tBodies[0], workers);
  const versions = Object.entries(data.model_versions || {}).map(([v, n]) => v + " × " + n);
  $("versions").textContent = versions.length ? "model versions: " + versions.join(", ") : "";
  renderTenants(data);
}

// Per class and tenant: what fair share is sharing out (held: queued without a broker message yet).
function renderTenants(data) {
  const rows = (data.tenants || []).map((t) => el("tr", { "data-queue": t.queue, "data-tenant": t.tenant },
    el("td", {}, t.queue), el("td", {}, t.tenant),
    el("td", { class: "num" }, t.weight === null || t.weight === undefined ? "–" : t.weight),
    el("td", { class: "num" }, t.queued), el("td", { class: "num" }, t.held), el("td", { class: "num" }, t.running),
    el("td", { class: "num" }, t.queued ? fmtSeconds(t.oldest_wait_seconds) : "–")));
  if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: 7, class: "muted" }, "no tenant has jobs waiting or running")));
  replaceRows($("tenants-table").tBodies[0], rows);
}

// Model versions side by side (canary first): the figures the promotion gate weighs.
function renderVersions(data) {
  const pct = (r) => (r === null || r === undefined ? "–" : (r * 100).toFixed(1) + "%");
  const rows = (data.versions || []).map((v) => el("tr", { "data-version": v.version, "data-track": v.track },
    el("td", {}, v.version), el("td", {}, v.track || "–"), el("td", { class: "num" }, v.workers_ready),
    el("td", { class: "num" }, v.jobs), el("td", { class: "num" }, pct(v.error_rate)),
    el("td", { class: "num" }, fmtSeconds(v.run_p50) + " / " + fmtSeconds(v.run_p95)),
    el("td", { class: "num" }, v.steps_mean === null ? "–" : v.steps_mean.toFixed(1)),
    el("td", { class: "num" }, (v.tokens_per_second || 0).toFixed(1)),
    el("td", { class: "num" }, v.invalid_output_retries)));
  if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: 9, class: "muted" }, "no version has served jobs yet")));
  replaceRows($("versions-table").tBodies[0], rows);
  const canaries = (data.canaries || []).map((c) => c.model + ": canary " + c.canary + " at " + c.percent + "% beside " + c.stable);
  $("canaries").textContent = canaries.length ? canaries.join(" · ") : "no canary in effect";
}

// ---------------------------------------------------------------------------------------------
// Latency charts: inline SVG scatter, one dot per finished job, coloured by queue

// One unit for a whole axis, chosen from its maximum (ticks never read "450 ms" then "0.90 s"),
// and round tick steps (1, 2, 2.5 or 5 times a power of ten) in that unit.
function axisScale(maxSeconds, ticks) {
  const unit = maxSeconds < 1 ? { name: "ms", per: 0.001 } : maxSeconds < 120 ? { name: "s", per: 1 } : { name: "min", per: 60 };
  const raw = maxSeconds / unit.per / ticks;
  const power = Math.pow(10, Math.floor(Math.log10(raw)));
  const mult = [1, 2, 2.5, 5, 10].find((m) => m * power >= raw * (1 - 1e-9));
  const step = mult * power;
  const decimals = Math.max(0, -Math.round(Math.log10(power)) - (mult === 10 ? 1 : 0) + (mult === 2.5 ? 1 : 0));
  return {
    max: step * ticks * unit.per,  // seconds
    label: (i) => (step * i).toFixed(decimals) + " " + unit.name,
  };
}

function drawChart(node, points, field) {
  const W = 560, H = 180, left = 50, right = 8, top = 8, bottom = 20, TICKS = 4;
  const ordered = points.slice().reverse(); // oldest first
  const values = ordered.map((p) => p[field] || 0);
  const scale = axisScale(Math.max(0.001, ...values) * 1.05, TICKS);
  const max = scale.max;
  const children = [];
  for (let i = 0; i <= TICKS; i += 1) {
    const y = top + (H - top - bottom) * (1 - i / TICKS);
    children.push(svg("line", { x1: left, x2: W - right, y1: y, y2: y, stroke: "#e3e6eb" }));
    children.push(svg("text", { x: left - 4, y: y + 3, "text-anchor": "end", class: "tick" }, scale.label(i)));
  }
  const n = ordered.length;
  ordered.forEach((p, i) => {
    const x = left + ((W - left - right) * (n === 1 ? 0.5 : i / (n - 1)));
    const y = top + (H - top - bottom) * (1 - (p[field] || 0) / max);
    const dot = svg("circle", { cx: x.toFixed(1), cy: y.toFixed(1), r: 3, fill: QUEUE_COLORS[p.queue] || "#999", "fill-opacity": 0.8 });
    dot.append(svg("title", {}, p.queue + " · " + p.id.slice(0, 8) + " · " + fmtSeconds(p[field])));
    children.push(dot);
  });
  children.push(svg("text", { x: left, y: H - 5 }, n ? fmtTime(ordered[0].finished_at) : "no finished jobs yet"));
  if (n) children.push(svg("text", { x: W - right, y: H - 5, "text-anchor": "end" }, fmtTime(ordered[n - 1].finished_at)));
  node.replaceChildren(...children);
}

function renderLatency(data) {
  drawChart($("chart-run"), data.points, "run_seconds");
  drawChart($("chart-wait"), data.points, "wait_seconds");
  $("legend").replaceChildren(...Object.entries(QUEUE_COLORS).map(([q, c]) =>
    el("span", {}, el("i", { style: "background:" + c }), q)));
}

// ---------------------------------------------------------------------------------------------
// Batches: list with progress, and the selected batch's jobs

function batchBar(batch) {
  // One segment per final status (and running), as a share of the batch's jobs.
  const total = Math.max(1, batch.total);
  const segments = BATCH_SEGMENTS.filter((s) => (batch.counts[s] || 0) > 0).map((s) =>
    el("div", { class: "seg", "data-status": s, title: (batch.counts[s] || 0) + " " + s,
      style: "width:" + ((100 * (batch.counts[s] || 0)) / total).toFixed(2) + "%;background:var(--" + s + ")" }));
  return el("div", { class: "bar stacked", role: "progressbar", "aria-valuemin": 0, "aria-valuemax": batch.total,
    "aria-valuenow": batch.finished }, segments);
}

function batchProgress(batch) {
  const pct = batch.total ? Math.floor((100 * batch.finished) / batch.total) : 100;
  return el("div", { class: "progress" }, batchBar(batch),
    el("span", { class: "progress-label" }, batch.finished + " / " + batch.total + " done (" + pct + "%)"));
}

function batchCounts(counts) {
  const parts = STATUSES.filter((s) => counts[s]).map((s) => counts[s] + " " + s);
  return parts.length ? parts.join(" · ") : "–";
}

function renderBatches(data) {
  const signature = JSON.stringify(data.items) + "|" + state.selectedBatch;
  if (signature === state.batchesSignature) return;
  state.batchesSignature = signature;
  const rows = data.items.map((b) => el("tr", { "data-batch-id": b.id, "data-status": b.status,
    class: b.id === state.selectedBatch ? "selected" : "", onclick: () => selectBatch(b.id) },
    el("td", { title: b.id }, el("code", {}, b.id.slice(0, 8))), el("td", {}, b.tenant),
    el("td", {}, badge(b.status)), el("td", { class: "progress-cell" }, batchProgress(b)),
    el("td", { class: "counts" }, batchCounts(b.counts)),
    el("td", {}, el("span", { class: "meta", title: fmtMeta(b.metadata) }, fmtMeta(b.metadata))),
    el("td", {}, fmtTime(b.created_at))));
  if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: 7, class: "muted" }, "no batches yet (POST /v1/batches)")));
  replaceRows($("batches-table").tBodies[0], rows);
}

function renderBatchDetail(batch) {
  const signature = JSON.stringify(batch) + "|" + state.selectedJob;
  if (signature === state.batchSignature) return;
  state.batchSignature = signature;
  const jobs = batch.jobs.map((job) => el("tr", { "data-job-id": job.id, "data-index": job.index,
    class: job.id === state.selectedJob ? "selected" : "", onclick: () => selectJob(job.id, { scroll: true }) },
    el("td", { class: "num" }, job.index), el("td", { title: job.id }, el("code", {}, job.id.slice(0, 8))),
    el("td", {}, badge(job.status)), el("td", {}, el("span", { class: "meta", title: fmtMeta(job.metadata) }, fmtMeta(job.metadata))),
    el("td", { class: "num" }, job.steps_used + (job.step_budget ? "/" + job.step_budget : "")),
    el("td", { class: "num" }, fmtSeconds(job.wait_seconds)), el("td", { class: "num" }, fmtSeconds(job.run_seconds))));
  const shown = batch.jobs.length < batch.total ? "first " + batch.jobs.length + " of " + batch.total + " jobs" : batch.total + " jobs";
  $("batch-detail-body").replaceChildren(
    el("h3", { class: "job-id" }, el("code", {}, batch.id), " ", badge(batch.status)),
    kv([["tenant", batch.tenant], ["created", batch.created_at ? new Date(batch.created_at).toLocaleString() : null],
      ["jobs", batchCounts(batch.counts)], ["metadata", fmtMeta(batch.metadata)]]),
    batchProgress(batch),
    el("h4", {}, "Jobs ", el("span", { class: "muted small" }, "(" + shown + ", in submission order)")),
    el("table", { id: "batch-jobs-table", class: "clickable" },
      el("thead", {}, el("tr", {}, ["#", "id", "status", "metadata", "steps", "wait", "run"].map((h) => el("th", {}, h)))),
      el("tbody", {}, jobs)));
  $("batch-detail-body").hidden = false;
  $("batch-detail-empty").hidden = true;
}

async function selectBatch(id) {
  state.selectedBatch = id;
  state.batchSignature = null;
  for (const row of $("batches-table").tBodies[0].rows) row.classList.toggle("selected", row.dataset.batchId === id);
  try {
    renderBatchDetail(await api("/v1/admin/batches/" + encodeURIComponent(id)));
  } catch (err) { handleError(err); }
}

// ---------------------------------------------------------------------------------------------
// Jobs table and detail

function filterQuery() {
  const params = new URLSearchParams();
  for (const [name, value] of new FormData($("filters")).entries()) if (value) params.set(name, value);
  params.set("limit", "50");
  return params.toString();
}

function renderJobs(data) {
  // Re-render only when the list changed: a stable DOM keeps clicks from landing on a row
  // that is being replaced by the refresh loop.
  const signature = JSON.stringify(data.items) + "|" + state.selectedJob;
  if (signature === state.jobsSignature) return;
  state.jobsSignature = signature;
  const rows = data.items.map((job) => {
    const row = el("tr", { "data-job-id": job.id, class: job.id === state.selectedJob ? "selected" : "",
      onclick: () => selectJob(job.id) },
      el("td", { title: job.id }, el("code", {}, job.id.slice(0, 8))), el("td", {}, job.tenant),
      el("td", {}, job.kind), el("td", {}, job.queue), el("td", {}, badge(job.status)),
      el("td", { class: "num" }, job.attempt + "/" + job.max_attempts),
      el("td", { class: "num" }, job.steps_used + (job.step_budget ? "/" + job.step_budget : "")),
      el("td", { class: "num" }, fmtSeconds(job.wait_seconds)), el("td", { class: "num" }, fmtSeconds(job.run_seconds)),
      el("td", {}, fmtTime(job.created_at)));
    return row;
  });
  if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: 10, class: "muted" }, "no jobs match")));
  replaceRows($("jobs-table").tBodies[0], rows);
}

function kv(pairs) {
  return el("dl", { class: "kv" }, pairs.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, v === null || v === undefined ? "–" : v)]));
}

function renderDetail(job) {
  const body = $("job-detail-body");
  const progress = job.progress || {};
  const budget = job.step_budget || progress.step_budget;
  const used = job.steps_used || progress.steps_used || 0;
  const pct = budget ? Math.min(100, Math.round((100 * used) / budget)) : (job.status === "succeeded" ? 100 : 0);
  const parts = [
    el("h3", { class: "job-id" }, el("code", {}, job.id), " ", badge(job.status)),
    kv([["tenant", job.tenant], ["kind", job.kind], ["queue / class", job.queue + " / " + job.priority],
      ["attempt", job.attempt + " of " + job.max_attempts], ["worker", job.worker_id], ["model version", job.model_version],
      ["request id", job.request_id],
      ["trace", job.trace_url ? el("a", { href: job.trace_url, target: "_blank", rel: "noopener noreferrer" }, job.trace_id)
        : job.trace_id],
      ["batch", job.batch_id ? el("a", { href: "#", class: "batch-link",
        onclick: (event) => { event.preventDefault(); selectBatch(job.batch_id); } }, job.batch_id.slice(0, 8)) : null],
      ["finish reason", job.finish_reason],
      ["wait / run", fmtSeconds(job.wait_seconds) + " / " + fmtSeconds(job.run_seconds)]]),
    el("h4", {}, "Steps"),
    el("div", { class: "muted" }, used + (budget ? " of " + budget + " denoising passes" : " denoising passes (no budget)")
      + (progress.blocks_done !== undefined ? " · " + progress.blocks_done + " blocks" : "")
      + (progress.tokens_committed !== undefined ? " · " + progress.tokens_committed + " tokens" : "")),
    el("div", { class: "bar" }, el("div", { style: "width:" + pct + "%" })),
  ];
  if (progress.prompt_tokens !== undefined && progress.prompt_tokens !== null) {
    // Prefill: the prompt's tokens the engine has run (0 of N while it prefills, then N).
    const done = progress.prompt_tokens_done || 0;
    const ppct = progress.prompt_tokens ? Math.min(100, Math.round((100 * done) / progress.prompt_tokens)) : 100;
    parts.push(el("h4", {}, "Prefill"),
      el("div", { class: "muted", id: "job-prefill" }, done + " of " + progress.prompt_tokens + " prompt tokens"),
      el("div", { class: "bar" }, el("div", { style: "width:" + ppct + "%" })));
  }
  if (job.metadata && Object.keys(job.metadata).length) {
    parts.push(el("h4", {}, "Metadata"), el("div", { id: "job-metadata" },
      kv(Object.entries(job.metadata).map(([k, v]) => [k, typeof v === "object" ? JSON.stringify(v) : String(v)]))));
  }
  parts.push(
    el("h4", {}, "Timeline"),
    el("ul", { class: "timeline" }, job.timeline.map((t) => el("li", {}, el("b", {}, t.event), " ", new Date(t.at).toLocaleString()))));
  if (job.usage) parts.push(el("h4", {}, "Usage"), kv(Object.entries(job.usage)));
  if (job.params) parts.push(el("h4", {}, "Params"), kv(Object.entries(job.params).map(([k, v]) => [k, typeof v === "object" ? JSON.stringify(v) : v])));
  if (job.error_code || job.error_message) {
    parts.push(el("h4", {}, "Error"), el("pre", { class: "err" }, (job.error_code || "") + (job.error_message ? ": " + job.error_message : "")));
  }
  body.replaceChildren(...parts);
  body.hidden = false;
  $("job-detail-empty").hidden = true;
}

async function selectJob(id, options) {
  state.selectedJob = id;
  for (const table of [$("jobs-table"), $("batch-jobs-table")]) {
    if (!table) continue;
    for (const row of table.tBodies[0].rows) row.classList.toggle("selected", row.dataset.jobId === id);
  }
  try {
    renderDetail(await api("/v1/admin/jobs/" + encodeURIComponent(id)));
    if (options && options.scroll) $("job-detail").scrollIntoView({ block: "nearest" });
  } catch (err) { handleError(err); }
}

// ---------------------------------------------------------------------------------------------
// Refresh loop and sign-in

async function refresh() {
  try {
    const [overview, jobs, latency, batches] = await Promise.all([
      api("/v1/admin/overview"), api("/v1/admin/jobs?" + filterQuery()), api("/v1/admin/latency?limit=200"),
      api("/v1/admin/batches?limit=20")]);
    showApp();
    renderOverview(overview);
    renderJobs(jobs);
    renderLatency(latency);
    renderBatches(batches);
    if (state.selectedBatch) renderBatchDetail(await api("/v1/admin/batches/" + encodeURIComponent(state.selectedBatch)));
    if (state.selectedJob) renderDetail(await api("/v1/admin/jobs/" + encodeURIComponent(state.selectedJob)));
    $("status-line").textContent = "updated " + new Date().toLocaleTimeString();
    document.body.dataset.loaded = "true";
  } catch (err) { handleError(err); }
}

function handleError(err) {
  if (err instanceof AuthError) {
    if (err.key !== state.key) return;  // refused under a key that is no longer the current one
    stop();
    state.key = null;
    sessionStorage.removeItem(KEY_STORAGE);
    // No key was sent (the first visit): the sign-in form, without a refusal nobody asked for.
    showLogin(err.key ? err.message : "");
  } else {
    $("status-line").textContent = "refresh failed: " + err.message;
  }
}

function showApp() {
  $("login").hidden = true;
  $("app").hidden = false;
  $("logout").hidden = !state.key;
}

function showLogin(message) {
  $("app").hidden = true;
  $("login").hidden = false;
  $("logout").hidden = true;
  $("status-line").textContent = "not signed in";
  const error = $("login-error");
  error.hidden = !message;
  error.textContent = message || "";
}

function start() {
  stop();
  refresh();
  state.timer = setInterval(refresh, REFRESH_MS);
}

function stop() {
  if (state.timer) clearInterval(state.timer);
  state.timer = null;
}

$("login-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = $("login-key").value.trim();
  if (!key) return;
  state.key = key;
  sessionStorage.setItem(KEY_STORAGE, key);
  $("login-key").value = "";
  start();
});

$("logout").addEventListener("click", () => {
  stop();
  state.key = null;
  sessionStorage.removeItem(KEY_STORAGE);
  showLogin("");
});

$("filters").addEventListener("change", refresh);
$("filters").addEventListener("submit", (event) => { event.preventDefault(); refresh(); });

// A one-time sign-in link (`cloverq up` prints <url>/dashboard#login=<code>): the code is in the
// fragment, which the browser never sends; it is dropped from the address bar at once and traded,
// once, for the key (POST /dashboard/login), which then lives in this tab like a typed one.
async function signInWithLink() {
  const match = /^#login=([A-Za-z0-9_-]+)$/.exec(location.hash);
  if (!match) return false;
  history.replaceState(null, "", location.pathname + location.search);
  try {
    const response = await fetch("/dashboard/login", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ code: match[1] }) });
    const body = await response.json();
    if (!response.ok) { showLogin(body.error && body.error.message || "This sign-in link did not work."); return true; }
    state.key = body.key;
    sessionStorage.setItem(KEY_STORAGE, body.key);
    start();
  } catch (err) {
    showLogin("This sign-in link did not work: " + err.message);
  }
  return true;
}

// With a stored key, or with auth disabled on the server, the first refresh succeeds at once.
signInWithLink().then((handled) => { if (!handled) start(); });
