// toposched web page: polls the JSON API every 2 s and redraws. No build step, no outside fetches.
// On opening it reads the signals' last hour from the service (/v1/signals/history), then adds a sample
// at each refresh.
// Every value from the API enters the page through textContent, setAttribute or a numeric style, never
// through innerHTML, so names in the cluster spec or a placement id cannot inject markup.
"use strict";

const POLL_MS = 2000;
const WINDOW_MS = 3600 * 1000; // the charts' span: the last hour
const ZOOM = [0, 4, 6, 10, 16, 24, 40]; // tile edge in px, smallest first; 0: one cell per NVLink domain
const AGGREGATE_ABOVE = 4096; // GPUs: a larger cluster opens on one cell per domain (tiles would be under 6 px)
const CELL = 10; // edge of a domain's cell in that view (px)
const LEGEND_MAX = 48; // placements listed in the colour legend (the table lists them all)
const GIB = 1024 ** 3;
const SVG = "http://www.w3.org/2000/svg";

// Placement colours, the most distinct first: none of them green (free tiles) or grey (unavailable ones).
// Each placement takes the first colour no live placement has (on opening, in the order of their ids) and
// keeps it while it lives; more placements than colours share them (the legend and hover text tell).
const PALETTE = [
  [31, 119, 180], [255, 127, 14], [148, 103, 189], [214, 39, 40], [23, 190, 207], [227, 119, 194],
  [140, 86, 75], [230, 171, 2], [57, 59, 121], [132, 60, 57], [107, 174, 214], [253, 174, 107],
  [123, 65, 115], [188, 128, 189], [82, 84, 163],
];
const FREE = [180, 230, 190]; // .tile.free in style.css
const HELD_ALL = [45, 51, 59]; // a domain cell with every GPU held (the aggregated view)

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
  mark: null, // {placement: id} or {alert: name}: whose GPUs are marked (a marked placement: pinned)
  marked: new Set(), // those GPU refs, found again at each redraw
  hover: null, // the placement under the pointer: its NVLink domains are highlighted
  colours: new Map(), // placement id -> index into PALETTE
  gpus: {}, // GPU ref -> the topology's GPU, from the last answer
  history: [], // [{t, signals}] of the last hour, oldest first (t: ms on this page's clock)
  recorded: 0, // how many of them the service had recorded before the page opened
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

const rgb = (c) => `rgb(${c[0]}, ${c[1]}, ${c[2]})`;

// A domain cell's colour: from the free tiles' green (none held) to near black (all held).
function shareColour(share) {
  return rgb(FREE.map((f, i) => Math.round(f + (HELD_ALL[i] - f) * share)));
}

// Give each new live placement the first colour no other has (all taken: the least used); forget the gone.
function assignColours(ids) {
  const live = new Set(ids);
  for (const id of [...view.colours.keys()]) if (!live.has(id)) view.colours.delete(id);
  const uses = PALETTE.map(() => 0);
  for (const slot of view.colours.values()) uses[slot] += 1;
  for (const id of [...live].sort()) {
    if (view.colours.has(id)) continue;
    const slot = uses.indexOf(Math.min(...uses));
    view.colours.set(id, slot);
    uses[slot] += 1;
  }
}

const colourOf = (id) => rgb(PALETTE[view.colours.get(id) || 0]);

function gpuState(g) {
  return g.placement ? "used" : g.free ? "free" : "down";
}

function hbmParts(g) {
  const h = g.hbm;
  const planned = h.weights + h.kv + h.other;
  const headroom = g.placement ? Math.max(h.capacity - planned, 0) : 0;
  return [["weights", h.weights], ["kv", h.kv], ["other", h.other], ["headroom", headroom]];
}

const planned = (g) => g.hbm.weights + g.hbm.kv + g.hbm.other;

function gpuTitle(g) {
  const h = g.hbm;
  const lines = [`${g.ref} (${g.model || "GPU"})`];
  if (g.placement) lines.push(`held by placement ${g.request} (instance ${g.placement})`);
  else lines.push(g.free ? "free" : `unavailable (health: ${g.health})`);
  const shown = view.last && view.last.byId.get(g.request);
  if (shown) lines.push(`${shown.model}, ${shapes(shown)}, ${sloState(shown)}`);
  lines.push(`NVLink domain ${g.domain || "none"}, NUMA ${g.numa || "unknown"}, PCIe switch ${g.pcie || "unknown"}`);
  if (g.placement) {
    lines.push(`HBM ${gib(planned(g))} of ${gib(h.capacity)} GiB planned: ${gib(h.weights)} weights, ${gib(h.kv)} KV, ${gib(h.other)} other`);
  } else lines.push(`HBM 0 of ${gib(h.capacity)} GiB used`);
  return lines.join("\n");
}

// A placement's TP x PP shapes ("TP4 x PP1"; replicas of other shapes listed too).
function shapes(p) {
  return [...new Set(p.instances.map((i) => `TP${i.tp} x PP${i.pp}`))].join(", ");
}

// Its SLO state: degraded (a sidecar said so), or whether the predictions meet the SLO, and the class.
function sloState(p) {
  const cls = (p.request && p.request.slo_class) || "interactive";
  if (p.status === "degraded") return `${cls}, degraded`;
  const checks = p.instances.flatMap((i) => (i.constraints || []).filter((c) => c.name === "slo"));
  if (!checks.length) return `${cls}, no SLO check`;
  return `${cls}, SLO ${checks.every((c) => c.held) ? "met" : "missed"}`;
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

// One GPU: its placement's colour, and (held, 10 px and up) how much of its HBM the plan uses.
function gpuTile(g, px, alerted) {
  const tile = el("span", { class: tileClass(g, alerted), "data-gpu": g.ref, title: gpuTitle(g) }, px >= 24 ? String(g.index) : undefined);
  if (!g.placement) return tile;
  tile.setAttribute("data-request", g.request);
  tile.style.backgroundColor = colourOf(g.request);
  if (px >= 24) tile.appendChild(hbmBar(g, "mini"));
  else if (px >= 10) {
    const bar = el("span", { class: "fill" });
    const used = el("span");
    used.style.width = ((100 * planned(g)) / (g.hbm.capacity || 1)).toFixed(1) + "%";
    bar.appendChild(used);
    tile.appendChild(bar);
  }
  if (px >= 40) tile.appendChild(el("span", { class: "gib" }, `${Math.round(planned(g) / GIB)}/${Math.round(g.hbm.capacity / GIB)}`));
  return tile;
}

function domainColumns(size) {
  return size <= 4 ? size : size <= 16 ? 4 : 8;
}

const looseBox = (node) => `${node} (no NVLink)`;
const boxOf = (g) => g.domain || looseBox(nodeOf(g.ref));

// Domains (and the GPUs outside any, one box per node) grouped by rack when the cluster names racks.
function domainGroups(topo, gpus) {
  const rackOf = {};
  for (const n of topo.nodes) rackOf[n.name] = n.rack ? `rack ${n.rack}` + (n.zone ? `, zone ${n.zone}` : "") : "";
  // a domain inside one node is labelled by the node; a multi-node one (NVL72) by its id
  const label = (d) => (d.kind === "mnnvl" ? d.id : nodeOf(d.gpus[0]));
  const boxes = topo.domains.map((d) => ({ id: d.id, label: label(d), refs: d.gpus, occupancy: d.occupancy }));
  // (a GPU outside every domain is boxed by its node: boxOf)
  const seen = new Set(boxes.flatMap((d) => d.refs));
  const loose = new Map();
  for (const ref of Object.keys(gpus)) {
    if (seen.has(ref)) continue;
    const node = nodeOf(ref);
    if (!loose.has(node)) loose.set(node, []);
    loose.get(node).push(ref);
  }
  for (const [node, refs] of loose) boxes.push({ id: looseBox(node), label: node, refs, occupancy: null });
  const racks = new Map();
  for (const box of boxes) {
    const rack = rackOf[nodeOf(box.refs[0])] || "";
    if (!racks.has(rack)) racks.set(rack, []);
    racks.get(rack).push(box);
  }
  return racks;
}

function autoZoom(n) {
  return n <= 64 ? 6 : n <= 512 ? 4 : n <= 2048 ? 3 : n <= AGGREGATE_ABOVE ? 2 : 0;
}

function rackHeading(rack, refs, gpus) {
  const free = refs.filter((r) => gpus[r].free).length;
  return el("h3", {}, `${rack}: ${refs.length} GPUs, ${free} free`);
}

function drawGrid(topo, alerts) {
  const gpus = view.gpus;
  if (view.zoom === null) view.zoom = autoZoom(topo.gpus);
  const px = ZOOM[view.zoom];
  const grid = document.getElementById("grid");
  grid.dataset.tile = String(px);
  grid.dataset.view = px ? "gpus" : "domains";
  grid.style.setProperty("--tile", px + "px");
  grid.className = "grid" + (px >= 10 ? " labelled" : "") + (px >= 24 ? " numbered" : "");
  document.getElementById("zoom-label").textContent = px ? `${px} px tiles` : "one cell per NVLink domain, its shade the share held";
  document.getElementById("share-legend").hidden = px !== 0;
  grid.replaceChildren();
  const racks = domainGroups(topo, gpus);
  const alerted = alertedGpus(alerts);
  if (!px) return drawDomainCells(grid, racks, gpus, alerted);
  for (const [rack, boxes] of racks) {
    const row = el("div", { class: "rack" });
    if (rack) row.appendChild(rackHeading(rack, boxes.flatMap((b) => b.refs), gpus));
    const domains = el("div", { class: "domains" });
    for (const d of boxes) {
      const pct = d.occupancy === null ? "" : ` ${Math.round(d.occupancy * 100)} %`;
      const box = el("div", { class: "domain", "data-domain": d.id, "data-node": nodeOf(d.refs[0]), title: d.occupancy === null ? d.id : `${d.id}:${pct} of its GPUs held` });
      if (d.occupancy !== null) box.style.borderColor = heat(d.occupancy);
      box.appendChild(el("h4", {}, px >= 24 ? d.label + pct : d.label));
      const cells = el("div", { class: "cells" });
      cells.style.gridTemplateColumns = `repeat(${domainColumns(d.refs.length)}, ${px}px)`;
      for (const ref of d.refs) cells.appendChild(gpuTile(gpus[ref], px, alerted));
      box.appendChild(cells);
      domains.appendChild(box);
    }
    row.appendChild(domains);
    grid.appendChild(row);
  }
}

// The aggregated view: per rack, one cell per NVLink domain (or node, for GPUs outside any), its shade the
// share of its GPUs held; the hover text gives the counts and the placements in it. A cell with unavailable
// GPUs is hatched grey over that shade, one with a GPU a firing alert names is ringed as an alerted tile is.
function drawDomainCells(grid, racks, gpus, alerted) {
  const perRow = racks.size > 1 ? 16 : 96; // racks side by side, or one wide block
  for (const [rack, boxes] of racks) {
    const row = el("div", { class: "rack" });
    if (rack) row.appendChild(rackHeading(rack, boxes.flatMap((b) => b.refs), gpus));
    const cells = el("div", { class: "dcells" });
    cells.style.gridTemplateColumns = `repeat(${Math.min(perRow, boxes.length)}, ${CELL}px)`;
    for (const d of boxes) {
      const list = d.refs.map((ref) => gpus[ref]);
      const held = list.filter((g) => g.placement).length;
      const free = list.filter((g) => g.free && !g.placement).length;
      const down = list.length - held - free;
      const holders = [...new Set(list.filter((g) => g.request).map((g) => g.request))];
      const more = holders.length > 6 ? ` and ${holders.length - 6} more` : "";
      const lines = [`${d.id}: ${list.length} GPUs, ${held} held, ${free} free, ${down} unavailable`];
      if (holders.length) lines.push(`placements: ${holders.slice(0, 6).join(", ")}${more}`);
      const cls = "dcell" + (list.some((g) => view.marked.has(g.ref)) ? " marked" : "")
        + (list.some((g) => alerted.has(g.ref)) ? " alerted" : "") + (down ? " down" : "");
      const cell = el("span", {
        class: cls, "data-domain": d.id, "data-node": nodeOf(d.refs[0]), "data-gpus": String(list.length),
        "data-held": String(held), "data-free": String(free), "data-down": String(down), title: lines.join("\n"),
      });
      cell.style.backgroundColor = shareColour(held / Math.max(list.length, 1));
      cells.appendChild(cell);
    }
    row.appendChild(cells);
    grid.appendChild(row);
  }
}

// The NVLink domains (boxes) a placement's GPUs sit in.
function spannedBoxes(request) {
  const out = new Set();
  if (!request) return out;
  for (const g of Object.values(view.gpus)) if (g.request === request) out.add(boxOf(g));
  return out;
}

// Highlight the domains of the placement under the pointer, else of the pinned (clicked) one.
function applyHighlight() {
  const pinned = view.mark && view.mark.placement ? view.mark.placement : null;
  const id = view.hover || pinned;
  const boxes = spannedBoxes(id);
  const grid = document.getElementById("grid");
  grid.dataset.highlight = id || "";
  grid.dataset.pinned = pinned || "";
  for (const b of grid.querySelectorAll("[data-domain]")) b.classList.toggle("spanned", boxes.has(b.dataset.domain));
  for (const t of grid.querySelectorAll(".tile[data-request]")) t.classList.toggle("lit", t.dataset.request === id);
  for (const li of document.querySelectorAll("#placement-legend li[data-request]")) li.classList.toggle("lit", li.dataset.request === id);
}

function setHover(request) {
  if (request === view.hover) return;
  view.hover = request;
  applyHighlight();
}

// The colour legend: each placement's colour, model, TP x PP shape and SLO state.
function drawLegend(placements) {
  const list = document.getElementById("placement-legend");
  list.replaceChildren();
  const shown = placements.placements.slice(0, LEGEND_MAX);
  for (const p of shown) {
    const li = el("li", { "data-request": p.id, title: "hover: its NVLink domains; click: keep them highlighted" });
    const swatch = el("span", { class: "swatch" });
    swatch.style.backgroundColor = colourOf(p.id);
    li.appendChild(swatch);
    li.appendChild(el("span", {}, ` ${p.id}: ${p.model}, ${shapes(p)}, ${sloState(p)}`));
    list.appendChild(li);
  }
  const rest = placements.placements.length - shown.length;
  if (rest > 0) list.appendChild(el("li", { class: "muted" }, `and ${rest} more placements (the table below lists them all)`));
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
  if (g.placement) card.style.borderLeftColor = colourOf(g.request);
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
    const swatch = el("span", { class: "swatch" });
    swatch.style.backgroundColor = colourOf(p.id);
    id.appendChild(swatch);
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

// Samples further apart than this are not joined by a line (three of the service's 10 s steps).
const GAP_MS = 30000;

// Minutes a chart spans: what the history covers, from 5 minutes to the hour.
function chartSpan(now) {
  const oldest = view.history.length ? view.history[0].t : now;
  return Math.min(60, Math.max(5, Math.ceil((now - oldest) / 60000)));
}

// A signal over chartSpan, right edge now; a gap where it had no value (or the service was not sampling).
function sparkline(name, kind, thresholds, now) {
  const w = 200, h = 40;
  const spanMs = chartSpan(now) * 60000;
  const values = view.history.map((s) => scalar(s.signals[name]));
  const limits = thresholds.filter((t) => t.signal === name);
  const top = Math.max(kind === "ratio" ? 1 : 0, ...values.filter((v) => v !== null), ...limits.map((t) => t.value)) || 1;
  const x = (i) => Math.max(0, w - ((now - view.history[i].t) / spanMs) * w);
  const y = (v) => h - 2 - (v / top) * (h - 4);
  const points = values.filter((v) => v !== null).length;
  const chart = svg("svg", { class: "spark", width: w, height: h, viewBox: `0 0 ${w} ${h}`, "data-points": points, "data-span-min": chartSpan(now) });
  for (const t of limits) chart.appendChild(svg("line", { class: "limit " + t.severity, x1: 0, x2: w, y1: y(t.value), y2: y(t.value) }));
  let run = [];
  const flush = () => {
    if (run.length === 1) chart.appendChild(svg("circle", { cx: run[0][0], cy: run[0][1], r: 1.5 }));
    if (run.length > 1) chart.appendChild(svg("polyline", { points: run.map((p) => p.join(",")).join(" ") }));
    run = [];
  };
  values.forEach((v, i) => {
    // no value, or no sample for three of the service's steps (it was down, or the tab was throttled): a gap
    if (v === null || (i > 0 && view.history[i].t - view.history[i - 1].t > GAP_MS)) flush();
    if (v !== null) run.push([x(i).toFixed(1), y(v).toFixed(1)]);
  });
  flush();
  return chart;
}

function drawSignals(alerts) {
  const box = document.getElementById("signals");
  box.replaceChildren();
  const firing = new Set(alerts.firing.map((a) => a.signal));
  const now = Date.now();
  for (const [name, label, kind] of SIGNALS) {
    const value = alerts.signals[name];
    const card = el("div", { class: "signal" + (firing.has(name) ? " firing" : ""), "data-signal": name, "data-samples": String(view.history.length), "data-recorded": String(view.recorded) });
    card.appendChild(el("div", { class: "signal-name" }, label));
    let text = formatValue(kind, scalar(value));
    if (value && typeof value === "object") {
      const parts = Object.entries(value).sort((a, b) => Number(a[0]) - Number(b[0])).map(([tp, n]) => `TP${tp}: ${n}`);
      if (parts.length) text += " (" + parts.join(", ") + ")";
    }
    card.appendChild(el("div", { class: "signal-value" }, text));
    card.appendChild(sparkline(name, kind, alerts.thresholds || [], now));
    card.appendChild(el("div", { class: "muted metric" }, `${name} (last ${chartSpan(now)} min)`));
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
  view.gpus = {};
  for (const n of topo.nodes) for (const g of n.gpus) view.gpus[g.ref] = g;
  assignColours(placements.placements.map((p) => p.id));
  if (view.hover && !view.last.byId.has(view.hover)) view.hover = null;
  document.getElementById("cluster").textContent =
    `${topo.cluster}: ${topo.gpus} GPUs on ${topo.nodes.length} nodes, ${topo.free} free (DomainMap v${topo.version}, ${topo.source})`;
  document.getElementById("clear-mark").hidden = view.marked.size === 0;
  drawGrid(topo, alerts);
  drawLegend(placements);
  applyHighlight();
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
    const first = view.last === null; // the page opens: the signals' last hour too (none from an older service)
    const past = first ? api("/v1/signals/history").catch(() => null) : Promise.resolve(null);
    answers = await Promise.all([api("/v1/topology"), api("/v1/placements"), api("/v1/queue"), api("/v1/alerts"), past]);
  } catch (err) {
    status.textContent = String(err.message || err);
    return;
  } finally {
    inFlight = false;
  }
  const [topo, placements, queue, alerts, past] = answers;
  if (view.last === null && view.node === null && topo.nodes.length === 1) view.node = topo.nodes[0].name;
  const byId = new Map(placements.placements.map((p) => [p.id, p]));
  view.last = { topo, placements, queue, alerts, byId };
  if (past) {
    const shift = Date.now() - past.now * 1000; // the service's clock onto this page's
    view.history = past.samples.map((s) => ({ t: s.t * 1000 + shift, signals: s.signals }));
    view.recorded = past.samples.length;
  }
  const now = Date.now();
  view.history.push({ t: now, signals: alerts.signals });
  while (view.history.length && now - view.history[0].t > WINDOW_MS) view.history.shift();
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

// A held tile (or a legend entry) pins its placement: GPUs marked, NVLink domains highlighted, its node
// shown below; clicking it again, or anywhere that is not a control, unpins. Other tiles and boxes open
// their node.
function pin(request, node) {
  if (view.mark && view.mark.placement === request) return mark(null);
  if (node) view.node = node;
  mark({ placement: request });
}

document.getElementById("grid").addEventListener("click", (ev) => {
  const target = ev.target.closest("[data-gpu], [data-node]");
  if (!target || !view.last) return;
  const ref = target.dataset.gpu;
  const g = ref && view.gpus[ref];
  if (g && g.request) return pin(g.request, nodeOf(ref));
  view.node = ref ? nodeOf(ref) : target.dataset.node;
  if (view.mark && view.mark.placement) view.mark = null; // an alert's marks stay: its GPUs show on the node
  draw();
  writeLink();
  document.getElementById("node").scrollIntoView({ block: "start" }); // below thousands of tiles, or off screen
});

for (const id of ["grid", "placement-legend"]) {
  const box = document.getElementById(id);
  box.addEventListener("mouseover", (ev) => {
    const target = ev.target.closest("[data-request]");
    setHover(target ? target.dataset.request : null);
  });
  box.addEventListener("mouseleave", () => setHover(null));
}

document.getElementById("placement-legend").addEventListener("click", (ev) => {
  const item = ev.target.closest("li[data-request]");
  if (item) pin(item.dataset.request, null);
});

document.addEventListener("click", (ev) => {
  const control = ev.target.closest("button, a, input, form, [data-gpu], [data-node], [data-request], [data-alert]");
  const selecting = String(window.getSelection() || "") !== ""; // the end of a text selection is not a click away
  if (!control && !selecting && view.mark) mark(null);
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
