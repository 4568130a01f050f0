// toposched web page: polls the JSON API every 2 s and redraws. No build step, no outside fetches.
// Every value from the API enters the page through textContent, setAttribute or a numeric style, never
// through innerHTML, so names in the cluster spec or a placement id cannot inject markup.
"use strict";

const POLL_MS = 2000;
const HISTORY = 300; // samples kept per signal: 10 minutes at one refresh every 2 s
const ZOOM = [4, 6, 10, 16, 24, 40]; // tile edge in px, smallest first
const GIB = 1024 ** 3;
const SVG = "http://www.w3.org/2000/svg";

// The nine signals: metric name, what it measures (no jargon), how to show a value.
const SIGNALS = [
  ["toposched_nvlink_affinity_ratio", "placements whose TP groups each sit in one NVLink domain", "ratio"],
  ["toposched_cross_domain_traffic_budget_ratio", "cross-domain traffic over its budget", "ratio"],
  ["toposched_hbm_utilization_ratio", "HBM the placements plan over HBM capacity", "ratio"],
  ["toposched_placements_by_tp", "live placements (by tensor-parallel degree)", "count"],
  ["toposched_sidecar_drift_ratio", "sidecar drift reports over instances placed", "ratio"],
  ["toposched_cross_domain_compression_ratio", "cross-domain traffic after compression over before", "ratio"],
  ["toposched_comm_overlap_ratio", "communication hidden behind compute", "ratio"],
  ["toposched_migration_ratio", "re-placements proposed over instances placed", "ratio"],
  ["toposched_cross_domain_p99_gap_seconds", "P99 latency of cross-domain minus intra-domain instances", "seconds"],
];

const view = {
  zoom: null, // index into ZOOM; chosen from the cluster size on the first answer
  node: null, // the node shown in detail, or null
  mark: null, // {placement: id} or {alert: name}: whose GPUs are marked
  marked: new Set(), // those GPU refs, found again at each redraw
  history: [], // [{t, signals}], oldest first
  last: null, // the last answers: {topo, placements, queue, alerts}
};

let pageErrors = 0;
function pageError(message) {
  pageErrors += 1;
  document.body.dataset.errors = String(pageErrors);
  document.getElementById("status").textContent = "page error: " + message;
}
window.addEventListener("error", (ev) => pageError(ev.message));
window.addEventListener("unhandledrejection", (ev) => pageError(String(ev.reason)));

// The address keeps what is shown, so a link can be shared: #node=NAME&placement=ID (or &alert=NAME).
// A token given there (#token=...) moves to session storage and leaves the address.
function readLink() {
  const link = new URLSearchParams(location.hash.slice(1));
  const given = /(?:^|[#&])token=([^&]+)/.exec(location.hash); // read raw: URLSearchParams turns "+" to " "
  if (given) sessionStorage.setItem("toposched-token", decodeURIComponent(given[1]));
  view.node = link.get("node");
  view.mark = link.has("placement") ? { placement: link.get("placement") } : link.has("alert") ? { alert: link.get("alert") } : null;
  writeLink();
}

function writeLink() {
  const link = new URLSearchParams();
  if (view.node) link.set("node", view.node);
  if (view.mark) for (const [k, v] of Object.entries(view.mark)) link.set(k, v);
  const hash = link.toString();
  history.replaceState(null, "", location.pathname + (hash ? "#" + hash : ""));
}

function token() {
  return sessionStorage.getItem("toposched-token") || "";
}

async function api(path) {
  const r = await fetch(path, { headers: { Authorization: "Bearer " + token() } });
  if (r.status === 401) {
    document.getElementById("login").hidden = false;
    throw new Error("unauthorized: give the API token");
  }
  if (!r.ok) throw new Error(path + ": HTTP " + r.status);
  return r.json();
}

function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function svg(tag, attrs) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
  return e;
}

const gib = (bytes) => (bytes / GIB).toFixed(1);
const nodeOf = (ref) => ref.slice(0, ref.lastIndexOf("/"));
const shortId = (id, node) => (id.startsWith(node + "/") ? id.slice(node.length + 1) : id);

// Domain border colour: dark green (empty) to dark red (full), the heat of the heat map; darker than the
// tiles' own green and red so that a full domain's border does not merge with its tiles.
function heat(occupancy) {
  const r = Math.round(26 + (164 - 26) * occupancy);
  const g = Math.round(127 + (14 - 127) * occupancy);
  const b = Math.round(55 + (38 - 55) * occupancy);
  return `rgb(${r}, ${g}, ${b})`;
}

function gpuState(g) {
  return g.placement ? "used" : g.free ? "free" : "down";
}

function hbmParts(g) {
  const h = g.hbm;
  const planned = h.weights + h.kv + h.other;
  const headroom = g.placement ? Math.max(h.capacity - planned, 0) : 0;
  return [["weights", h.weights], ["kv", h.kv], ["other", h.other], ["headroom", headroom]];
}

function gpuTitle(g) {
  const h = g.hbm;
  const lines = [`${g.ref} (${g.model || "GPU"})`];
  if (g.placement) lines.push(`held by placement ${g.request} (instance ${g.placement})`);
  else lines.push(g.free ? "free" : `unavailable (health: ${g.health})`);
  lines.push(`NVLink domain ${g.domain || "none"}, NUMA ${g.numa || "unknown"}, PCIe switch ${g.pcie || "unknown"}`);
  lines.push(`HBM ${gib(h.capacity)} GiB` + (g.placement ? `: ${gib(h.weights)} weights, ${gib(h.kv)} KV, ${gib(h.other)} other` : ""));
  return lines.join("\n");
}

// A horizontal bar: weights, KV, other, headroom as shares of the GPU's capacity.
function hbmBar(g, cls) {
  const bar = el("div", { class: cls });
  const cap = g.hbm.capacity || 1;
  for (const [part, bytes] of hbmParts(g)) {
    if (bytes <= 0) continue;
    const seg = el("span", { class: "seg " + part, "data-bytes": String(bytes) });
    seg.style.width = ((100 * bytes) / cap).toFixed(2) + "%";
    bar.appendChild(seg);
  }
  return bar;
}

function alertedGpus(alerts) {
  const out = new Set();
  for (const a of alerts.firing) for (const ref of a.gpus || []) out.add(ref);
  return out;
}

function tileClass(g, alerted) {
  let cls = "tile " + gpuState(g);
  if (alerted.has(g.ref)) cls += " alerted";
  if (view.marked.has(g.ref)) cls += " marked";
  return cls;
}

function domainColumns(size) {
  return size <= 4 ? size : size <= 16 ? 4 : 8;
}

// Domains (and the GPUs outside any, one box per node) grouped by rack when the cluster names racks.
function domainGroups(topo, gpus) {
  const rackOf = {};
  for (const n of topo.nodes) rackOf[n.name] = n.rack ? `rack ${n.rack}` + (n.zone ? `, zone ${n.zone}` : "") : "";
  // a domain inside one node is labelled by the node; a multi-node one (NVL72) by its id
  const label = (d) => (d.kind === "mnnvl" ? d.id : nodeOf(d.gpus[0]));
  const boxes = topo.domains.map((d) => ({ id: d.id, label: label(d), refs: d.gpus, occupancy: d.occupancy }));
  const seen = new Set(boxes.flatMap((d) => d.refs));
  const loose = new Map();
  for (const ref of Object.keys(gpus)) {
    if (seen.has(ref)) continue;
    const node = nodeOf(ref);
    if (!loose.has(node)) loose.set(node, []);
    loose.get(node).push(ref);
  }
  for (const [node, refs] of loose) boxes.push({ id: `${node} (no NVLink)`, label: node, refs, occupancy: null });
  const racks = new Map();
  for (const box of boxes) {
    const rack = rackOf[nodeOf(box.refs[0])] || "";
    if (!racks.has(rack)) racks.set(rack, []);
    racks.get(rack).push(box);
  }
  return racks;
}

function drawGrid(topo, alerts) {
  const gpus = {};
  for (const n of topo.nodes) for (const g of n.gpus) gpus[g.ref] = g;
  if (view.zoom === null) {
    const n = topo.gpus;
    view.zoom = n <= 64 ? 5 : n <= 512 ? 3 : n <= 2048 ? 2 : 1;
  }
  const px = ZOOM[view.zoom];
  const alerted = alertedGpus(alerts);
  const grid = document.getElementById("grid");
  grid.dataset.tile = String(px);
  grid.style.setProperty("--tile", px + "px");
  grid.className = "grid" + (px >= 10 ? " labelled" : "") + (px >= 24 ? " numbered" : "");
  document.getElementById("zoom-label").textContent = `${px} px tiles`;
  grid.replaceChildren();
  for (const [rack, boxes] of domainGroups(topo, gpus)) {
    const row = el("div", { class: "rack" });
    if (rack) {
      const refs = boxes.flatMap((b) => b.refs);
      const free = refs.filter((r) => gpus[r].free).length;
      row.appendChild(el("h3", {}, `${rack}: ${refs.length} GPUs, ${free} free`));
    }
    const domains = el("div", { class: "domains" });
    for (const d of boxes) {
      const pct = d.occupancy === null ? "" : ` ${Math.round(d.occupancy * 100)} %`;
      const box = el("div", { class: "domain", "data-domain": d.id, "data-node": nodeOf(d.refs[0]), title: d.occupancy === null ? d.id : `${d.id}:${pct} of its GPUs held` });
      if (d.occupancy !== null) box.style.borderColor = heat(d.occupancy);
      box.appendChild(el("h4", {}, px >= 24 ? d.label + pct : d.label));
      const cells = el("div", { class: "cells" });
      cells.style.gridTemplateColumns = `repeat(${domainColumns(d.refs.length)}, ${px}px)`;
      for (const ref of d.refs) {
        const g = gpus[ref];
        const tile = el("span", { class: tileClass(g, alerted), "data-gpu": ref, title: gpuTitle(g) }, px >= 24 ? String(g.index) : undefined);
        if (px >= 24 && g.placement) tile.appendChild(hbmBar(g, "mini"));
        cells.appendChild(tile);
      }
      box.appendChild(cells);
      domains.appendChild(box);
    }
    row.appendChild(domains);
    grid.appendChild(row);
  }
}

function drawNode(topo, alerts) {
  const section = document.getElementById("node");
  const node = topo.nodes.find((n) => n.name === view.node);
  if (!node) {
    view.node = null;
    section.hidden = true;
    return;
  }
  section.hidden = false;
  const where = node.rack ? ` (rack ${node.rack}` + (node.zone ? `, zone ${node.zone})` : ")") : "";
  document.getElementById("node-name").textContent = node.name + where;
  const alerted = alertedGpus(alerts);
  const numa = new Map(); // NUMA group -> PCIe group -> GPUs
  for (const g of node.gpus) {
    const n = g.numa ? "NUMA " + shortId(g.numa, node.name) : "NUMA node unknown";
    const p = g.pcie ? "PCIe switch " + shortId(g.pcie, node.name) : "no PCIe switch shared with another GPU (or not known)";
    if (!numa.has(n)) numa.set(n, new Map());
    if (!numa.get(n).has(p)) numa.get(n).set(p, []);
    numa.get(n).get(p).push(g);
  }
  const body = document.getElementById("node-body");
  body.replaceChildren();
  for (const [n, switches] of numa) {
    const box = el("div", { class: "numa", "data-numa": n });
    box.appendChild(el("h3", {}, n));
    for (const [p, list] of switches) {
      const sw = el("div", { class: "pcie", "data-pcie": p });
      sw.appendChild(el("h4", {}, p));
      const cards = el("div", { class: "cards" });
      for (const g of list) cards.appendChild(gpuCard(g, alerted));
      sw.appendChild(cards);
      box.appendChild(sw);
    }
    body.appendChild(box);
  }
}

function gpuCard(g, alerted) {
  const state = gpuState(g);
  const card = el("div", { class: "gpu " + state + (alerted.has(g.ref) ? " alerted" : "") + (view.marked.has(g.ref) ? " marked" : ""), "data-gpu": g.ref, title: gpuTitle(g) });
  card.appendChild(el("div", { class: "gpu-head" }, `GPU ${g.index}`));
  card.appendChild(el("div", { class: "muted" }, `${g.model || "model unknown"}, NVLink ${g.domain ? shortId(g.domain, nodeOf(g.ref)) : "none"}`));
  card.appendChild(hbmBar(g, "hbm"));
  const h = g.hbm;
  if (g.placement) {
    const holder = el("button", { type: "button", class: "link", "data-request": g.request }, `placement ${g.request}`);
    card.appendChild(holder);
    card.appendChild(el("div", { class: "muted" }, `${gib(h.weights)} weights + ${gib(h.kv)} KV + ${gib(h.other)} other of ${gib(h.capacity)} GiB`));
  } else {
    card.appendChild(el("div", {}, g.free ? "free" : `unavailable (health: ${g.health})`));
    card.appendChild(el("div", { class: "muted" }, `${gib(h.capacity)} GiB`));
  }
  return card;
}

// "node/0,1,2,3 node2/4,5": a placement's GPUs by node, short enough for a table cell.
function gpuList(refs) {
  const byNode = new Map();
  for (const ref of refs) {
    const node = nodeOf(ref);
    if (!byNode.has(node)) byNode.set(node, []);
    byNode.get(node).push(ref.slice(node.length + 1));
  }
  return [...byNode].map(([node, idx]) => `${node}/${idx.join(",")}`).join(" ");
}

function drawPlacements(placements) {
  const body = document.querySelector("#placements tbody");
  body.replaceChildren();
  for (const p of placements.placements) {
    const tr = el("tr", { "data-request": p.id });
    if (view.mark && view.mark.placement === p.id) tr.className = "selected";
    const id = el("td");
    id.appendChild(el("button", { type: "button", class: "link", "data-request": p.id }, p.id));
    tr.appendChild(id);
    const first = p.instances[0];
    const h = first ? first.hbm_per_gpu : null;
    const hbm = h ? `${gib(h.weights)} weights, ${gib(h.kv)} KV, ${gib(h.activations + h.workspace)} other (GiB)` : "";
    const cols = [p.model, p.instances.map((i) => `${i.tp}x${i.pp}`).join(" "), gpuList(p.instances.flatMap((i) => i.gpus)), hbm, p.status];
    for (const c of cols) tr.appendChild(el("td", {}, String(c)));
    body.appendChild(tr);
  }
}

function drawQueue(queue) {
  const body = document.querySelector("#queue tbody");
  body.replaceChildren();
  for (const q of queue.items) {
    const tr = el("tr");
    for (const c of [q.id, q.slo_class, q.gpus, q.waited_s]) tr.appendChild(el("td", {}, String(c)));
    body.appendChild(tr);
  }
}

function drawAlerts(alerts) {
  const ul = document.getElementById("alerts");
  ul.replaceChildren();
  if (!alerts.firing.length) ul.appendChild(el("li", {}, "none"));
  for (const a of alerts.firing) {
    const li = el("li", { class: a.severity, "data-alert": a.alert });
    li.appendChild(el("span", {}, `${a.severity} ${a.alert}: ${a.summary} (${Number(a.value).toFixed(3)}) `));
    const refs = a.gpus || [];
    if (refs.length) {
      li.appendChild(el("button", { type: "button", class: "link", "data-alert": a.alert }, `mark its ${refs.length} GPU${refs.length > 1 ? "s" : ""}`));
    } else {
      li.appendChild(el("span", { class: "muted" }, "cluster-wide: no GPU to point at"));
    }
    ul.appendChild(li);
  }
}

function formatValue(kind, value) {
  if (value === null || value === undefined) return "no source";
  if (kind === "ratio") return (100 * value).toFixed(1) + " %";
  if (kind === "seconds") return (1000 * value).toFixed(0) + " ms";
  return String(value);
}

// A signal's value as one number (placements by TP: their sum), or null.
function scalar(value) {
  if (value === null || value === undefined) return null;
  if (typeof value === "object") return Object.values(value).reduce((s, v) => s + v, 0);
  return value;
}

function sparkline(name, kind, thresholds) {
  const w = 200, h = 40;
  const values = view.history.map((s) => scalar(s.signals[name]));
  const limits = thresholds.filter((t) => t.signal === name);
  const top = Math.max(kind === "ratio" ? 1 : 0, ...values.filter((v) => v !== null), ...limits.map((t) => t.value)) || 1;
  const x = (i) => w - (values.length - 1 - i) * (w / (HISTORY - 1));
  const y = (v) => h - 2 - (v / top) * (h - 4);
  const chart = svg("svg", { class: "spark", width: w, height: h, viewBox: `0 0 ${w} ${h}` });
  for (const t of limits) chart.appendChild(svg("line", { class: "limit " + t.severity, x1: 0, x2: w, y1: y(t.value), y2: y(t.value) }));
  let run = [];
  const flush = () => {
    if (run.length === 1) chart.appendChild(svg("circle", { cx: run[0][0], cy: run[0][1], r: 1.5 }));
    if (run.length > 1) chart.appendChild(svg("polyline", { points: run.map((p) => p.join(",")).join(" ") }));
    run = [];
  };
  values.forEach((v, i) => (v === null ? flush() : run.push([x(i).toFixed(1), y(v).toFixed(1)])));
  flush();
  return chart;
}

function drawSignals(alerts) {
  const box = document.getElementById("signals");
  box.replaceChildren();
  const firing = new Set(alerts.firing.map((a) => a.signal));
  for (const [name, label, kind] of SIGNALS) {
    const now = alerts.signals[name];
    const card = el("div", { class: "signal" + (firing.has(name) ? " firing" : ""), "data-signal": name, "data-samples": String(view.history.length) });
    card.appendChild(el("div", { class: "signal-name" }, label));
    let text = formatValue(kind, scalar(now));
    if (now && typeof now === "object") {
      const parts = Object.entries(now).sort((a, b) => Number(a[0]) - Number(b[0])).map(([tp, n]) => `TP${tp}: ${n}`);
      if (parts.length) text += " (" + parts.join(", ") + ")";
    }
    card.appendChild(el("div", { class: "signal-value" }, text));
    card.appendChild(sparkline(name, kind, alerts.thresholds || []));
    card.appendChild(el("div", { class: "muted metric" }, name));
    box.appendChild(card);
  }
}

// The GPUs of the marked placement or alert, as the latest answers say.
function markedGpus(placements, alerts) {
  const m = view.mark || {};
  const p = placements.placements.find((x) => x.id === m.placement);
  if (p) return p.instances.flatMap((i) => i.gpus);
  const a = alerts.firing.find((x) => x.alert === m.alert);
  return a ? a.gpus || [] : [];
}

function draw() {
  const { topo, placements, queue, alerts } = view.last;
  view.marked = new Set(markedGpus(placements, alerts));
  document.getElementById("cluster").textContent =
    `${topo.cluster}: ${topo.gpus} GPUs on ${topo.nodes.length} nodes, ${topo.free} free (DomainMap v${topo.version}, ${topo.source})`;
  document.getElementById("clear-mark").hidden = view.marked.size === 0;
  drawGrid(topo, alerts);
  drawNode(topo, alerts);
  drawSignals(alerts);
  drawAlerts(alerts);
  drawPlacements(placements);
  drawQueue(queue);
}

let inFlight = false; // a slow answer (a large cluster) skips the next tick instead of piling requests up

async function refresh() {
  if (inFlight) return;
  const status = document.getElementById("status");
  let answers;
  inFlight = true;
  try {
    answers = await Promise.all([api("/v1/topology"), api("/v1/placements"), api("/v1/queue"), api("/v1/alerts")]);
  } catch (err) {
    status.textContent = String(err.message || err);
    return;
  } finally {
    inFlight = false;
  }
  const [topo, placements, queue, alerts] = answers;
  if (view.last === null && view.node === null && topo.nodes.length === 1) view.node = topo.nodes[0].name;
  view.last = { topo, placements, queue, alerts };
  view.history.push({ t: Date.now(), signals: alerts.signals });
  if (view.history.length > HISTORY) view.history.shift();
  draw(); // a drawing bug is not caught here: it counts as a page error
  status.textContent = "updated " + new Date().toLocaleTimeString();
  document.body.dataset.loaded = "yes";
}

// Mark a placement's or an alert's GPUs; a mark within one node opens that node.
function mark(what) {
  view.mark = what;
  if (view.last) {
    const nodes = new Set(markedGpus(view.last.placements, view.last.alerts).map(nodeOf));
    if (nodes.size === 1) view.node = [...nodes][0];
    draw();
  }
  writeLink();
}

function scrollToRow(request) {
  for (const tr of document.querySelectorAll("#placements tbody tr")) {
    if (tr.dataset.request === request) tr.scrollIntoView({ block: "center" });
  }
}

document.getElementById("grid").addEventListener("click", (ev) => {
  const target = ev.target.closest("[data-gpu], [data-node]");
  if (!target || !view.last) return;
  const ref = target.dataset.gpu;
  const g = ref && view.last.topo.nodes.flatMap((n) => n.gpus).find((x) => x.ref === ref);
  view.node = ref ? nodeOf(ref) : target.dataset.node;
  if (g && g.request) mark({ placement: g.request });
  else {
    draw();
    writeLink();
  }
  document.getElementById("node").scrollIntoView({ block: "start" });
});

document.getElementById("node-body").addEventListener("click", (ev) => {
  const button = ev.target.closest("button[data-request]");
  if (!button) return;
  mark({ placement: button.dataset.request });
  scrollToRow(button.dataset.request);
});

document.getElementById("placements").addEventListener("click", (ev) => {
  const button = ev.target.closest("button[data-request]");
  if (!button) return;
  mark({ placement: button.dataset.request });
  document.getElementById("overview").scrollIntoView({ block: "start" });
});

document.getElementById("alerts").addEventListener("click", (ev) => {
  const button = ev.target.closest("button[data-alert]");
  if (!button || !view.last) return;
  mark({ alert: button.dataset.alert });
  document.getElementById("overview").scrollIntoView({ block: "start" });
});

document.getElementById("clear-mark").addEventListener("click", () => mark(null));

document.getElementById("node-close").addEventListener("click", () => {
  view.node = null;
  if (view.last) draw();
  writeLink();
});

for (const [id, step] of [["zoom-in", 1], ["zoom-out", -1]]) {
  document.getElementById(id).addEventListener("click", () => {
    if (view.zoom === null || !view.last) return;
    view.zoom = Math.min(ZOOM.length - 1, Math.max(0, view.zoom + step));
    draw();
  });
}

document.getElementById("login").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem("toposched-token", document.getElementById("token").value);
  document.getElementById("login").hidden = true;
  refresh();
});

readLink();
refresh();
setInterval(refresh, POLL_MS);
