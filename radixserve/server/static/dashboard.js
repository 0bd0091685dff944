// radixserve's live dashboard: polls /dashboard/data and draws it with plain SVG (no library, nothing fetched
// from elsewhere). The API key, if the server wants one, lives in this tab's sessionStorage only.
"use strict";

const POLL_MS = 1500;
const TREE_EVERY = 2; // polls: the tree walk is the costly part of a poll
const TREE_NODES = 120;
const HISTORY = 120; // samples kept (3 minutes at 1.5 s)
const RATE_WINDOW = 10; // samples the headline hit rate sums over
const TIMELINE_ROWS = 30;
const KEY_ITEM = "radixserve-api-key";
const SVG_NS = "http://www.w3.org/2000/svg";
const COLOURS = ["#2f6fdb", "#e0742b", "#2a9d5c", "#9b59b6", "#c0392b"];

const state = { history: [], polls: 0, tree: null, treeNodes: 0, viewer: null, timer: null };
const $ = (id) => document.getElementById(id);

function svg(tag, attrs, parent) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attrs || {})) el.setAttribute(name, value);
  if (parent) parent.appendChild(el);
  return el;
}

function fmt(n, digits = 1) {
  if (n === null || n === undefined || Number.isNaN(n)) return "-";
  const abs = Math.abs(n);
  for (const [size, unit] of [[1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]]) {
    if (abs >= size) return (n / size).toFixed(digits) + unit;
  }
  return Number.isInteger(n) ? String(n) : n.toFixed(digits);
}

const pct = (x) => (x === null || x === undefined ? "-" : (100 * x).toFixed(1) + "%");

function setStatus(text, error) {
  $("status").textContent = text;
  $("status").classList.toggle("error", Boolean(error));
}

// ---- polling ------------------------------------------------------------------------------------

function schedule() {
  clearTimeout(state.timer);
  state.timer = setTimeout(poll, POLL_MS);
}

async function poll() {
  const key = sessionStorage.getItem(KEY_ITEM) || "";
  const tree = state.polls % TREE_EVERY === 0 ? TREE_NODES : 0;
  state.polls += 1;
  let response;
  try {
    const headers = key ? { Authorization: "Bearer " + key } : {};
    response = await fetch("/dashboard/data?tree=" + tree, { headers, cache: "no-store" });
  } catch (err) {
    setStatus("server unreachable: retrying", true);
    return schedule();
  }
  if (response.status === 401) {
    $("key-form").hidden = false;
    setStatus(key ? "the server refused this API key" : "this server needs an API key", true);
    return; // polling resumes when a key is given
  }
  if (!response.ok) {
    setStatus("error " + response.status + " from /dashboard/data", true);
    return schedule();
  }
  update(await response.json());
  schedule();
}

function setupKeyForm() {
  $("key-form").hidden = !sessionStorage.getItem(KEY_ITEM);
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY_ITEM, $("key").value.trim());
    $("key").value = "";
    poll();
  });
  $("forget-key").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_ITEM);
    state.history = [];
    poll();
  });
}

// ---- samples and rates --------------------------------------------------------------------------

function sample(data) {
  const traffic = {};
  for (const [name, tier] of Object.entries(data.tiers || {})) {
    traffic[name + " in"] = tier.loaded_bytes;
    traffic[name + " out"] = tier.stored_bytes;
  }
  return {
    t: data.time,
    prompt: data.totals.prompt_tokens,
    cached: data.totals.cached_tokens,
    generated: data.totals.generated_tokens,
    running: data.load.running,
    waiting: data.load.waiting,
    evicted: Object.fromEntries(data.evictions.map((e) => [e.tier + " " + e.policy + " (" + e.unit + ")", e.evicted])),
    traffic,
  };
}

function record(data) {
  const now = sample(data);
  const last = state.history[state.history.length - 1];
  if (last && (now.prompt < last.prompt || now.generated < last.generated)) state.history = []; // a restart
  state.history.push(now);
  if (state.history.length > HISTORY) state.history.shift();
}

// d(a)/d(b) between samples i-window and i; null where b did not move
function ratio(i, window, a, b) {
  const h = state.history;
  const from = h[Math.max(i - window, 0)];
  const db = b(h[i]) - b(from);
  return db > 0 ? (a(h[i]) - a(from)) / db : null;
}

function rateSeries(value) {
  const h = state.history;
  return h.map((s, i) => [s.t, i === 0 ? null : (value(s) - value(h[i - 1])) / Math.max(s.t - h[i - 1].t, 1e-6)]);
}

// ---- charts -------------------------------------------------------------------------------------

// ``ceiling``: a fixed top of the y axis (a rate's 100%); else 10% above the largest value
function lineChart(el, series, format, ceiling) {
  el.replaceChildren();
  delete el.dataset.max;
  const width = el.clientWidth || 320;
  const height = el.clientHeight || 130;
  const pad = { l: 44, r: 6, t: 16, b: 14 };
  const points = series.flatMap((s) => s.points.filter((p) => p[1] !== null));
  if (!points.length) {
    svg("text", { x: pad.l, y: height / 2 }, el).textContent = "waiting for traffic...";
    return;
  }
  const t0 = Math.min(...points.map((p) => p[0]));
  const t1 = Math.max(...points.map((p) => p[0]), t0 + 1);
  const top = Math.max(...points.map((p) => p[1]));
  el.dataset.max = top; // the largest value drawn (tests read it)
  const yMax = ceiling || top * 1.1 || 1;
  const x = (t) => pad.l + ((t - t0) / (t1 - t0)) * (width - pad.l - pad.r);
  const y = (v) => height - pad.b - (v / yMax) * (height - pad.t - pad.b);
  for (const v of [0, yMax / 2, yMax]) {
    svg("line", { x1: pad.l, x2: width - pad.r, y1: y(v), y2: y(v), stroke: "#eceef2" }, el);
    svg("text", { x: pad.l - 4, y: y(v) + 3, "text-anchor": "end" }, el).textContent = format(v);
  }
  svg("text", { x: pad.l, y: height - 2 }, el).textContent = "-" + Math.round(t1 - t0) + " s";
  svg("text", { x: width - pad.r, y: height - 2, "text-anchor": "end" }, el).textContent = "now";
  let legendX = pad.l + 4;
  series.forEach((s, k) => {
    let d = "";
    let pen = "M";
    for (const [t, v] of s.points) {
      if (v === null) {
        pen = "M";
        continue;
      }
      d += pen + x(t).toFixed(1) + "," + y(v).toFixed(1) + " ";
      pen = "L";
    }
    svg("path", { d, fill: "none", stroke: COLOURS[k % COLOURS.length], "stroke-width": 1.8 }, el);
    const label = svg("text", { x: legendX, y: 11 }, el);
    label.textContent = s.name;
    label.setAttribute("style", "fill:" + COLOURS[k % COLOURS.length]);
    legendX += 6 * s.name.length + 14;
  });
}

function drawCharts() {
  const h = state.history;
  const hitRate = h.map((s, i) => [s.t, ratio(i, 1, (x) => x.cached, (x) => x.prompt)]);
  const smooth = h.map((s, i) => [s.t, ratio(i, RATE_WINDOW, (x) => x.cached, (x) => x.prompt)]);
  lineChart($("chart-hit-rate"), [{ name: "per poll", points: hitRate }, { name: "15 s", points: smooth }], pct, 1);
  lineChart($("chart-saved"), [{ name: "tokens", points: h.map((s) => [s.t, s.cached]) }], fmt);
  lineChart(
    $("chart-load"),
    [{ name: "running", points: h.map((s) => [s.t, s.running]) }, { name: "queued", points: h.map((s) => [s.t, s.waiting]) }],
    fmt,
  );
  lineChart($("chart-tps"), [{ name: "tokens/s", points: rateSeries((s) => s.generated) }], fmt);
  const latest = h.length ? h[h.length - 1] : { evicted: {}, traffic: {} };
  const rates = (field) =>
    Object.keys(latest[field]).map((name) => ({ name, points: rateSeries((s) => s[field][name] || 0) }));
  lineChart($("chart-evictions"), rates("evicted"), fmt);
  lineChart($("chart-traffic"), rates("traffic"), (v) => fmt(v) + "B");
}

function drawTiles(data) {
  const h = state.history;
  const i = h.length - 1;
  $("hit-rate").textContent = pct(ratio(i, RATE_WINDOW, (x) => x.cached, (x) => x.prompt));
  const totals = data.totals;
  $("hit-rate-total").textContent = totals.prompt_tokens ? pct(totals.cached_tokens / totals.prompt_tokens) : "-";
  $("tokens-saved").textContent = fmt(totals.cached_tokens);
  $("tokens-saved").dataset.value = totals.cached_tokens;
  const tps = i > 0 ? rateSeries((s) => s.generated)[i][1] : null;
  $("tokens-per-s").textContent = fmt(tps);
  $("running").textContent = String(data.load.running);
  $("waiting").textContent = String(data.load.waiting);
  $("tokens-per-s").dataset.value = tps ?? "";
}

// ---- tiers --------------------------------------------------------------------------------------

function tierRow(name, parts, capacity, note) {
  const row = document.createElement("div");
  row.className = "tier";
  const label = document.createElement("b");
  label.textContent = name;
  const bar = document.createElement("div");
  bar.className = "bar";
  for (const [value, colour, title] of parts) {
    const seg = document.createElement("i");
    seg.style.width = (capacity ? (100 * value) / capacity : 0) + "%";
    seg.style.background = colour;
    seg.title = title + ": " + fmt(value);
    bar.appendChild(seg);
  }
  const text = document.createElement("small");
  text.textContent = note;
  row.append(label, bar, text);
  return row;
}

function drawTiers(data) {
  const p = data.pool;
  const rows = [
    tierRow(
      "pool (L1)",
      [
        [p.live_request_tokens, "#2a9d5c", "live requests"],
        [p.protected_tokens, "#e0742b", "cached, locked"],
        [p.evictable_tokens, "#2f6fdb", "cached, evictable"],
      ],
      p.pool_tokens,
      fmt(p.live_request_tokens) + " live, " + fmt(p.protected_tokens) + " locked, " + fmt(p.evictable_tokens) +
        " evictable of " + fmt(p.pool_tokens) + " tokens",
    ),
  ];
  const h = state.history;
  for (const [name, tier] of Object.entries(data.tiers || {})) {
    const label = name === "host" ? "host (L2)" : "disk (L3)";
    const rate = (way) => (h.length > 1 ? rateSeries((s) => s.traffic[name + way] || 0)[h.length - 1][1] : 0);
    const capacity = tier.capacity_bytes === null ? "no limit" : fmt(tier.capacity_bytes) + "B";
    const note =
      fmt(tier.used_bytes) + "B of " + capacity + ", " + fmt(tier.hit_tokens) + " hit tokens, " +
      fmt(rate(" in")) + "B/s in, " + fmt(rate(" out")) + "B/s out";
    const used = [[tier.used_bytes, "#9b59b6", "used"]];
    rows.push(tierRow(label, used, tier.capacity_bytes ?? Math.max(tier.used_bytes, 1) * 1.25, note));
  }
  if (!data.tiers) {
    const none = document.createElement("small");
    none.textContent = "no tiers below the pool (start with --hicache-size / --cache-dir for L2 / L3)";
    rows.push(none);
  }
  $("tiers").replaceChildren(...rows);
}

// ---- the radix tree as an icicle --------------------------------------------------------------------

function heat(node) {
  if ($("colour-by").value === "hits") return 1 - Math.min(Math.log2(1 + node.hit_count) / 6, 1);
  return Math.min(node.age_s / 120, 1); // 0: used just now
}

function levels(node) {
  return node.children.length ? 1 + Math.max(...node.children.map(levels)) : 0;
}

function drawIcicle() {
  const el = $("icicle");
  el.replaceChildren();
  const tree = state.tree;
  if (!tree) {
    svg("text", { x: 10, y: 20 }, el).textContent = "the prefix cache is not a radix tree";
    return;
  }
  const root = tree.root;
  const depth = Math.max(levels(root), 1);
  const rowHeight = Math.max(22, Math.min(44, 240 / depth));
  el.style.height = depth * rowHeight + "px";
  const width = el.clientWidth || 800;
  $("tree-note").textContent =
    tree.shown + " of " + tree.nodes + " nodes shown, " + fmt(root.subtree_tokens) + " tokens" +
    (state.viewer && !state.viewer.text ? "; prompt text hidden for this key" : "");
  if (!root.children.length) svg("text", { x: 10, y: 16 }, el).textContent = "the cache is empty";
  const place = (node, x0, x1, row) => {
    let x = x0;
    for (const child of node.children) {
      const w = ((x1 - x0) * child.subtree_tokens) / Math.max(node.subtree_tokens, 1);
      drawNode(el, child, x, w, row, rowHeight);
      place(child, x, x + w, row + 1);
      x += w;
    }
  };
  place(root, 0, width, 0);
}

function drawNode(el, node, x, w, row, rowHeight) {
  const fill = "hsl(" + Math.round(220 * heat(node)) + ", 65%, 50%)";
  const rect = svg("rect", { x, y: row * rowHeight, width: Math.max(w, 0.5), height: rowHeight, fill }, el);
  rect.dataset.hits = node.hit_count;
  rect.dataset.tokens = node.tokens;
  rect.dataset.row = row;
  rect.addEventListener("mousemove", (event) => showTooltip(event, node));
  rect.addEventListener("mouseleave", () => ($("tooltip").hidden = true));
  if (w > 70) {
    const label = svg("text", { x: x + 4, y: row * rowHeight + rowHeight / 2 + 4 }, el);
    label.textContent = fmt(node.tokens) + " tok, " + node.hit_count + " hits";
  }
}

function showTooltip(event, node) {
  const tip = $("tooltip");
  const lines = [
    node.tokens + " tokens on this edge (" + node.subtree_tokens + " below it), starting at token " + node.depth_tokens,
    node.hit_count + " hits, last used " + node.age_s.toFixed(1) + " s ago" + (node.lock_ref ? ", in use" : ""),
    "namespace: " + (node.namespace || "shared"),
    node.head_text !== undefined ? "head: " + JSON.stringify(node.head_text) : "head: (not shown to this key)",
  ];
  tip.textContent = lines.join("\n");
  tip.hidden = false;
  tip.style.left = Math.min(event.clientX + 12, window.innerWidth - 430) + "px";
  tip.style.top = event.clientY + 12 + "px";
}

// ---- the request timeline -----------------------------------------------------------------------

function drawTimeline(requests) {
  const el = $("timeline");
  el.replaceChildren();
  const shown = requests.slice(-TIMELINE_ROWS).reverse(); // newest on top
  const rowHeight = 14;
  const width = el.clientWidth || 800;
  el.style.height = Math.max(shown.length, 1) * rowHeight + 20 + "px";
  if (!shown.length) {
    svg("text", { x: 10, y: 14 }, el).textContent = "no finished request yet";
    return;
  }
  const span = Math.max(...shown.map((r) => r.arrival_ago_s), 0.001);
  const left = 190;
  const x = (ago) => left + (1 - ago / span) * (width - left - 10);
  shown.forEach((r, row) => {
    const y = row * rowHeight + 2;
    const label = svg("text", { x: 4, y: y + 10 }, el);
    label.textContent = "#" + r.rid + " " + r.prompt_tokens + " tok (" + r.cached_tokens + " cached) +" + r.output_tokens;
    const phases = [
      ["queue", r.arrival_ago_s, r.admitted_ago_s ?? r.finish_ago_s],
      ["prefill", r.admitted_ago_s, r.first_token_ago_s ?? r.finish_ago_s],
      ["decode", r.first_token_ago_s, r.finish_ago_s],
    ];
    for (const [phase, start, end] of phases) {
      if (start === null || end === null) continue;
      const bar = svg("rect", { x: x(start), y, width: Math.max(x(end) - x(start), 1), height: rowHeight - 3 }, el);
      bar.setAttribute("class", "phase " + phase);
      bar.setAttribute("style", "fill: var(--" + phase + ")");
      svg("title", {}, bar).textContent = phase + ": " + ((start - end) * 1000).toFixed(1) + " ms";
    }
  });
  const axis = shown.length * rowHeight + 14;
  svg("text", { x: left, y: axis }, el).textContent = "-" + span.toFixed(1) + " s";
  svg("text", { x: width - 10, y: axis, "text-anchor": "end" }, el).textContent = "last poll";
}

// ---- one poll's answer --------------------------------------------------------------------------------

function update(data) {
  record(data);
  state.viewer = data.viewer;
  $("model").textContent = data.model;
  drawTiles(data);
  drawCharts();
  drawTiers(data);
  if (data.tree) {
    state.tree = data.tree;
    drawIcicle();
  }
  drawTimeline(data.requests);
  setStatus("updated " + new Date().toLocaleTimeString() + (data.viewer.namespaces === "own" ? " (your namespaces)" : ""));
}

setupKeyForm();
$("colour-by").addEventListener("change", drawIcicle);
poll();
