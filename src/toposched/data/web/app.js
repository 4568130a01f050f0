// toposched web page: polls the JSON API every 2 s and redraws. No build step, no outside fetches.
"use strict";

const POLL_MS = 2000;

function token() {
  const m = /(?:^|[#&])token=([^&]+)/.exec(location.hash);
  if (m) {
    sessionStorage.setItem("toposched-token", decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname);
  }
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

// Domain border colour: green (empty) to red (full), the heat of the heat map.
function heat(occupancy) {
  const r = Math.round(46 + (207 - 46) * occupancy);
  const g = Math.round(160 + (34 - 160) * occupancy);
  const b = Math.round(67 + (46 - 67) * occupancy);
  return `rgb(${r}, ${g}, ${b})`;
}

function drawGrid(topo) {
  document.getElementById("cluster").textContent =
    `${topo.cluster}: ${topo.gpus} GPUs, ${topo.free} free (DomainMap v${topo.version}, ${topo.source})`;
  const gpus = {};
  for (const n of topo.nodes) for (const g of n.gpus) gpus[g.ref] = g;
  const grid = document.getElementById("grid");
  grid.replaceChildren();
  const seen = new Set();
  const groups = topo.domains.map((d) => ({ id: d.id, refs: d.gpus, occupancy: d.occupancy }));
  for (const d of groups) for (const r of d.refs) seen.add(r);
  const loose = Object.keys(gpus).filter((r) => !seen.has(r));
  if (loose.length) groups.push({ id: "no NVLink domain", refs: loose, occupancy: null });
  for (const d of groups) {
    const box = el("div", { class: "domain", "data-domain": d.id });
    if (d.occupancy !== null) box.style.borderColor = heat(d.occupancy);
    const pct = d.occupancy === null ? "" : ` ${Math.round(d.occupancy * 100)} %`;
    box.appendChild(el("h3", {}, d.id + pct));
    const cells = el("div", { class: "cells" });
    for (const ref of d.refs) {
      const g = gpus[ref];
      const state = g.placement ? "used" : g.free ? "free" : "down";
      const cell = el("span", { class: "cell " + state, "data-gpu": ref, title: ref + (g.placement ? " " + g.placement : "") }, String(g.index));
      cells.appendChild(cell);
    }
    box.appendChild(cells);
    grid.appendChild(box);
  }
}

function drawRows(id, rows) {
  const body = document.querySelector(`#${id} tbody`);
  body.replaceChildren();
  for (const cols of rows) {
    const tr = el("tr");
    for (const c of cols) tr.appendChild(el("td", {}, String(c)));
    body.appendChild(tr);
  }
}

function drawAlerts(alerts) {
  const ul = document.getElementById("alerts");
  ul.replaceChildren();
  if (!alerts.firing.length) ul.appendChild(el("li", {}, "none"));
  for (const a of alerts.firing) {
    ul.appendChild(el("li", { class: a.severity }, `${a.severity} ${a.alert}: ${a.summary} (${Number(a.value).toFixed(3)})`));
  }
}

async function refresh() {
  const status = document.getElementById("status");
  try {
    const [topo, placements, queue, alerts] = await Promise.all([
      api("/v1/topology"), api("/v1/placements"), api("/v1/queue"), api("/v1/alerts"),
    ]);
    drawGrid(topo);
    drawRows("placements", placements.placements.map((p) => [
      p.id, p.model, p.instances.map((i) => `${i.tp}x${i.pp}`).join(" "),
      p.instances.map((i) => i.gpus.join(",")).join(" "), p.status,
    ]));
    drawRows("queue", queue.items.map((q) => [q.id, q.slo_class, q.gpus, q.waited_s]));
    drawAlerts(alerts);
    status.textContent = "updated " + new Date().toLocaleTimeString();
    document.body.dataset.loaded = "yes";
  } catch (err) {
    status.textContent = String(err.message || err);
  }
}

document.getElementById("login").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem("toposched-token", document.getElementById("token").value);
  document.getElementById("login").hidden = true;
  refresh();
});

refresh();
setInterval(refresh, POLL_MS);
