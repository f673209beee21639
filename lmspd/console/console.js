// lmspd web console: plain browser JavaScript, no build step, no external asset.
// It speaks the public API (/v1/models, /v1/responses, /lmsp/v1/tasks) plus
// the read-only /lmsp/v1/engine. Model text is only ever set as textContent.
"use strict";

const KEY_SLOT = "lmspd-api-key"; // sessionStorage: this tab only
const MAX_TURNS_CHARTED = 40;
const $ = (sel) => document.querySelector(sel);

// -- credentials ---------------------------------------------------------------

function apiKey() { return sessionStorage.getItem(KEY_SLOT); }

function headers(extra = {}) {
  const h = { ...extra };
  const key = apiKey();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

let keyWaiters = [];
function askForKey(message) {
  const dialog = $("#key-dialog");
  const err = $("#key-error");
  err.hidden = !message;
  err.textContent = message || "";
  if (!dialog.open) dialog.showModal();
  $("#key-input").focus();
  return new Promise((resolve) => keyWaiters.push(resolve));
}

$("#key-form").addEventListener("submit", () => {
  const value = $("#key-input").value.trim();
  if (!value) return;
  sessionStorage.setItem(KEY_SLOT, value);
  $("#key-input").value = "";
  $("#forget-key").hidden = false;
  const waiters = keyWaiters; keyWaiters = [];
  waiters.forEach((w) => w());
});

$("#forget-key").addEventListener("click", () => {
  sessionStorage.removeItem(KEY_SLOT);
  location.reload();
});

// fetch, asking for a key on 401 and retrying once it is given.
async function api(path, options = {}) {
  for (;;) {
    const resp = await fetch(path, { ...options, headers: headers(options.headers || {}) });
    if (resp.status !== 401) return resp;
    await askForKey(apiKey() ? "That key was not accepted." : "");
  }
}

async function errorText(resp) {
  try {
    const body = await resp.json();
    return (body.error && body.error.message) || body.detail || JSON.stringify(body);
  } catch (e) { return resp.status + " " + resp.statusText; }
}

// -- SSE over fetch (EventSource cannot send a key or a body) -----------------

async function* sse(resp) {
  const reader = resp.body.getReader();
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
      let name = "message", data = "", id = null;
      for (const line of frame.split("\n")) {
        if (line.startsWith("event:")) name = line.slice(6).trim();
        else if (line.startsWith("data:")) data += line.slice(5).trim();
        else if (line.startsWith("id:")) id = line.slice(3).trim();
      }
      if (!data || data === "[DONE]") continue;
      try { yield { name, id, data: JSON.parse(data) }; } catch (e) { /* not JSON: skip */ }
    }
  }
}

// -- tabs ----------------------------------------------------------------------

let activeTab = "playground";
document.querySelectorAll(".tab").forEach((btn) => btn.addEventListener("click", () => {
  activeTab = btn.dataset.tab;
  document.querySelectorAll(".tab").forEach((b) => b.classList.toggle("active", b === btn));
  document.querySelectorAll(".panel").forEach((p) => p.classList.toggle("active", p.id === activeTab));
  if (activeTab === "engine") refreshEngine();
}));

// -- chart: stacked bars of reused (bottom) and prefilled tokens -------------

const SVG = "http://www.w3.org/2000/svg";
function drawChart(svg, rows) {
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const width = svg.clientWidth || 300, height = svg.clientHeight || 160, pad = 18;
  const max = Math.max(1, ...rows.map((r) => r.reused + r.prefilled));
  const slot = (width - pad) / Math.max(rows.length, 8);
  const barW = Math.max(2, slot * 0.7);
  const scale = (height - pad) / max;
  const el = (tag, attrs) => {
    const e = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    svg.appendChild(e);
    return e;
  };
  el("line", { x1: pad, y1: height - pad, x2: width, y2: height - pad, class: "axis" });
  const label = el("text", { x: 2, y: 10, class: "axis-label" });
  label.textContent = max + " tok";
  rows.forEach((r, i) => {
    const x = pad + i * slot + (slot - barW) / 2;
    const hReused = r.reused * scale, hPre = r.prefilled * scale;
    const reused = el("rect", { x, width: barW, y: height - pad - hReused, height: hReused, class: "bar reused" });
    const pre = el("rect", { x, width: barW, y: height - pad - hReused - hPre, height: hPre, class: "bar prefilled" });
    const tip = `${r.label}: reused ${r.reused}, prefilled ${r.prefilled}`;
    for (const bar of [reused, pre]) {
      const t = document.createElementNS(SVG, "title");
      t.textContent = tip;
      bar.appendChild(t);
    }
  });
  svg.dataset.bars = String(rows.length);
}

// -- playground ----------------------------------------------------------------

let previousId = null;
let turns = [];
let controller = null;

async function loadModels() {
  const resp = await api("/v1/models");
  if (!resp.ok) { $("#status").textContent = await errorText(resp); return; }
  const body = await resp.json();
  const select = $("#model");
  select.textContent = "";
  for (const m of body.data) {
    const opt = document.createElement("option");
    opt.value = m.id;
    opt.textContent = m.served === false ? `${m.id} (found, not served)` : m.id;
    opt.disabled = m.served === false;
    select.appendChild(opt);
  }
  $("#status").textContent = `${body.data.filter((m) => m.served !== false).length} model(s) served`;
}

function bubble(role) {
  const div = document.createElement("div");
  div.className = "turn " + role;
  $("#transcript").appendChild(div);
  return div;
}

function part(parent, cls, text = "") {
  const el = document.createElement("div");
  el.className = cls;
  el.textContent = text;
  parent.appendChild(el);
  return el;
}

function scrollDown() { const t = $("#transcript"); t.scrollTop = t.scrollHeight; }

$("#new-chat").addEventListener("click", () => {
  previousId = null;
  $("#transcript").textContent = "";
});

$("#stop").addEventListener("click", () => controller && controller.abort());

$("#message").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("#send-form").requestSubmit(); }
});

$("#send-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  const text = $("#message").value.trim();
  if (!text || controller) return;
  $("#message").value = "";
  part(bubble("user"), "text", text);
  const out = bubble("assistant");
  const meta = part(out, "meta muted", "waiting…");
  const body = {
    model: $("#model").value, input: text, stream: true,
    max_output_tokens: Number($("#max-tokens").value) || 128,
  };
  const instructions = $("#instructions").value.trim();
  if (instructions) body.instructions = instructions;
  if ($("#continue").checked && previousId) body.previous_response_id = previousId;
  controller = new AbortController();
  $("#send").hidden = true; $("#stop").hidden = false;
  const started = performance.now();
  let firstAt = null;
  const items = {}; // output_index -> element
  let textEl = null;
  try {
    const resp = await api("/v1/responses", {
      method: "POST", body: JSON.stringify(body), signal: controller.signal,
      headers: { "Content-Type": "application/json" },
    });
    if (!resp.ok) { meta.textContent = await errorText(resp); meta.className = "meta error"; return; }
    for await (const ev of sse(resp)) {
      const d = ev.data;
      if (firstAt === null && /delta$/.test(ev.name)) firstAt = performance.now();
      switch (ev.name) {
        case "response.created":
          meta.textContent = "generating…";
          break;
        case "response.output_item.added":
          if (d.item.type === "function_call" || d.item.type === "custom_tool_call") {
            const call = part(out, "tool-call");
            part(call, "tool-name", "→ " + d.item.name);
            items[d.output_index] = part(call, "tool-args");
          } else if (d.item.type === "reasoning") {
            items[d.output_index] = part(out, "reasoning");
          } else if (d.item.type === "message") {
            textEl = items[d.output_index] = part(out, "text");
          }
          break;
        case "response.output_text.delta":
          (textEl || (textEl = part(out, "text"))).textContent += d.delta;
          break;
        case "response.reasoning_text.delta":
        case "response.reasoning_summary_text.delta":
          (items[d.output_index] || (items[d.output_index] = part(out, "reasoning"))).textContent += d.delta;
          break;
        case "response.function_call_arguments.delta":
        case "response.custom_tool_call_input.delta":
          if (items[d.output_index]) items[d.output_index].textContent += d.delta;
          break;
        case "response.completed":
        case "response.incomplete":
          previousId = d.response.id;
          finishTurn(meta, d.response, started, firstAt);
          break;
        case "response.failed":
          meta.textContent = "failed: " + ((d.response.error && d.response.error.message) || "error");
          meta.className = "meta error";
          break;
        case "error":
          meta.textContent = "error: " + (d.message || JSON.stringify(d));
          meta.className = "meta error";
          break;
      }
      scrollDown();
    }
  } catch (err) {
    if (err.name !== "AbortError") { meta.textContent = String(err); meta.className = "meta error"; }
    else meta.textContent = "stopped";
  } finally {
    controller = null;
    $("#send").hidden = false; $("#stop").hidden = true;
    if (activeTab === "engine") refreshEngine();
  }
});

function finishTurn(meta, response, started, firstAt) {
  const u = response.usage || {};
  const cached = (u.input_tokens_details && u.input_tokens_details.cached_tokens) || 0;
  const secs = (performance.now() - started) / 1000;
  const ttft = firstAt === null ? null : Math.round(firstAt - started);
  meta.textContent = `${response.status} · input ${u.input_tokens} · cached ${cached} · output ${u.output_tokens}` +
    (ttft === null ? "" : ` · first token ${ttft} ms`) + ` · ${secs.toFixed(2)} s`;
  meta.dataset.cachedTokens = String(cached);
  meta.className = "meta usage";
  turns.push({ label: "turn " + (turns.length + 1), reused: cached, prefilled: (u.input_tokens || 0) - cached });
  const row = document.createElement("tr");
  for (const v of [turns.length, u.input_tokens, cached, u.output_tokens, secs.toFixed(2) + "s"]) {
    const td = document.createElement("td"); td.textContent = String(v); row.appendChild(td);
  }
  $("#turn-usage tbody").appendChild(row);
  drawChart($("#turn-chart"), turns.slice(-MAX_TURNS_CHARTED));
}

// -- engine view ---------------------------------------------------------------

function mib(n) { return n == null ? "?" : (n / 1048576).toFixed(1) + " MiB"; }

function kv(parent, pairs) {
  const dl = document.createElement("dl");
  for (const [k, v] of pairs) {
    const dt = document.createElement("dt"); dt.textContent = k;
    const dd = document.createElement("dd"); dd.textContent = String(v);
    dl.append(dt, dd);
  }
  parent.appendChild(dl);
}

async function refreshEngine() {
  const resp = await api("/lmsp/v1/engine");
  if (!resp.ok) { $("#engine-models").textContent = await errorText(resp); return; }
  const view = await resp.json();
  const box = $("#engine-models");
  box.textContent = "";
  for (const m of view.models) {
    const card = document.createElement("div");
    card.className = "card";
    part(card, "card-title", m.id + " · " + m.engine);
    const c = m.cache || {};
    kv(card, [
      ["queue", `${m.queue.running} running / ${m.queue.pending} waiting (max ${m.queue.max_pending})`],
      ["generations", m.generations],
      ["RAM tier", `${c.ram_sessions ?? 0} sessions · ${mib(c.ram_bytes)} of ${mib(c.ram_budget_bytes)}`],
      ["disk tier", `${c.disk_checkpoints ?? 0} checkpoints · ${mib(c.disk_bytes)} of ${mib(c.disk_budget_bytes)}`],
      ["last", m.last.last_cache_source ? `${m.last.last_cache_source} · reused ${m.last.last_reused_tokens} · prefilled ${m.last.last_prefilled_tokens}` : "-"],
    ]);
    for (const p of m.prefilling || []) {
      // A long prompt being evaluated: tokens done of its total, live.
      const row = part(card, "prefill", "");
      const pct = p.total ? Math.floor((100 * p.done) / p.total) : 100;
      part(row, "prefill-text", `prefilling seq ${p.seq} (${p.owner}): ${p.done} / ${p.total} tokens (${pct}%)` +
        (p.reused ? ` · ${p.reused} reused` : ""));
      const bar = document.createElement("progress");
      bar.max = p.total || 1; bar.value = p.done;
      row.appendChild(bar);
    }
    if (m.sessions.length) {
      const table = document.createElement("table");
      table.className = "small";
      const keys = Object.keys(m.sessions[0]);
      const head = table.createTHead().insertRow();
      keys.forEach((k) => { const th = document.createElement("th"); th.textContent = k; head.appendChild(th); });
      const tbody = table.createTBody();
      for (const s of m.sessions) {
        const row = tbody.insertRow();
        keys.forEach((k) => { row.insertCell().textContent = String(s[k]); });
      }
      card.appendChild(table);
    }
    if (m.endpoints) {
      kv(card, m.endpoints.map((e) => [e.url, `${e.healthy ? "healthy" : "down"} · ${e.outstanding} open · ${e.requests} routed`]));
    }
    box.appendChild(card);
  }
  const recent = view.recent;
  const tbody = $("#recent tbody");
  tbody.textContent = "";
  for (const r of recent) {
    const row = tbody.insertRow();
    const when = new Date(r.at * 1000).toLocaleTimeString();
    for (const v of [when, r.model, r.response_id || "", r.outcome, r.cache_source, r.reused_tokens,
                     r.prefilled_tokens, r.output_tokens, r.ttft_ms ?? "", r.decode_tokens_per_s ?? ""]) {
      row.insertCell().textContent = String(v);
    }
  }
  drawChart($("#engine-chart"), recent.slice().reverse().map((r) => ({
    label: r.response_id || r.model, reused: r.reused_tokens, prefilled: r.prefilled_tokens,
  })));
}

setInterval(() => { if (activeTab === "engine" && !document.hidden) refreshEngine(); }, 1000);

// -- tasks ---------------------------------------------------------------------

const TASKS_SLOT = "lmspd-tasks";
let followed = null;

function knownTasks() { return JSON.parse(sessionStorage.getItem(TASKS_SLOT) || "[]"); }
function remember(id) {
  const ids = knownTasks().filter((t) => t !== id);
  ids.unshift(id);
  sessionStorage.setItem(TASKS_SLOT, JSON.stringify(ids.slice(0, 20)));
}

async function refreshTasks() {
  const tbody = $("#task-list tbody");
  const rows = [];
  for (const id of knownTasks()) {
    const resp = await api("/lmsp/v1/tasks/" + encodeURIComponent(id));
    if (!resp.ok) continue;
    const t = await resp.json();
    let text = "";
    if (t.result && t.result.output) {
      for (const item of t.result.output) {
        for (const c of item.content || []) if (c.text) text += c.text;
      }
    }
    rows.push([t.id, t.status, t.last_event_id, text.slice(0, 200)]);
  }
  tbody.textContent = "";
  for (const r of rows) {
    const row = tbody.insertRow();
    r.forEach((v) => { row.insertCell().textContent = String(v); });
    row.addEventListener("click", () => follow(r[0]));
  }
}

async function follow(id) {
  if (followed) followed.abort();
  followed = new AbortController();
  $("#task-followed").textContent = id;
  const pre = $("#task-events");
  pre.textContent = "";
  try {
    const resp = await api(`/lmsp/v1/tasks/${encodeURIComponent(id)}/events`, { signal: followed.signal });
    if (!resp.ok) { pre.textContent = await errorText(resp); return; }
    for await (const ev of sse(resp)) {
      pre.textContent += `${ev.id ?? ""} ${ev.name} ${JSON.stringify(ev.data)}\n`;
    }
  } catch (err) { if (err.name !== "AbortError") pre.textContent += String(err); }
  refreshTasks();
}

$("#task-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  const text = $("#task-input").value.trim();
  if (!text) return;
  const resp = await api("/lmsp/v1/tasks", {
    method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ model: $("#model").value, input: text, max_output_tokens: Number($("#max-tokens").value) || 128 }),
  });
  if (!resp.ok) { $("#task-events").textContent = await errorText(resp); return; }
  const task = await resp.json();
  remember(task.id);
  $("#task-input").value = "";
  await refreshTasks();
  follow(task.id);
});

$("#follow").addEventListener("click", () => {
  const id = $("#task-id").value.trim();
  if (!id) return;
  remember(id);
  follow(id);
});

// -- start -----------------------------------------------------------------------

if (apiKey()) $("#forget-key").hidden = false;
loadModels().then(refreshTasks);
