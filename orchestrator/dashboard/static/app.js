// fabtrain dashboard: polls the server's read-only JSON and draws it. Every text goes in with
// textContent (never as markup), so what a host or a container printed is shown as the text it is.
"use strict";

const POLL_MS = 3000;
let timer = null;
let planFor = null;

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function row(cells) {
  const tr = document.createElement("tr");
  for (const c of cells) {
    const td = document.createElement("td");
    if (c instanceof Node) td.appendChild(c); else td.textContent = c === null || c === undefined ? "-" : String(c);
    tr.appendChild(td);
  }
  return tr;
}

function fill(tableId, rows, empty) {
  const body = document.querySelector(`#${tableId} tbody`);
  body.replaceChildren(...rows);
  if (!rows.length) {
    const tr = row([empty]);
    tr.firstChild.colSpan = document.querySelectorAll(`#${tableId} thead th`).length;
    tr.className = "dim";
    body.appendChild(tr);
  }
}

function when(t) {
  if (!t) return "-";
  const d = new Date(t * 1000);
  return d.toLocaleString(undefined, {hour12: false});
}

function num(x, digits) {
  return x === null || x === undefined ? "-" : Number(x).toLocaleString(undefined, {maximumFractionDigits: digits});
}

function owner(who) {
  return who ? who : "-";
}

function jobLink(job) {
  const a = el("a", job);
  a.href = "#/job/" + encodeURIComponent(job);
  return a;
}

async function getJSON(path) {
  const r = await fetch(path, {cache: "no-store", credentials: "same-origin"});
  const body = await r.json();
  if (!r.ok) throw new Error(body.error || r.statusText);
  return body;
}

function unitsText(units) {
  if (!units || !units.length) return "";
  return units.join(",");
}

function renderHosts(doc) {
  const box = document.getElementById("hosts");
  const cards = [];
  for (const h of doc.hosts) {
    const card = el("div", null, "host" + (h.answered ? "" : " down"));
    card.dataset.host = h.host;
    const head = el("div", null, "host-head");
    head.appendChild(el("strong", h.host));
    if (h.answered) {
      const load = h.load || {};
      head.appendChild(el("span", ` ${h.kind}s: ${h.slots.length} | load ${num(load.load1, 2)} / ${load.cpus || "-"} cpus`, "dim"));
    } else {
      head.appendChild(el("span", " not answering: " + (h.error || "?"), "bad"));
    }
    card.appendChild(head);
    const slots = el("div", null, "slots");
    for (const s of h.slots) {
      const cell = el("div", null, "slot" + (s.job ? " held" : ""));
      cell.dataset.unit = s.unit;
      cell.dataset.job = s.job || "";
      cell.dataset.who = s.who || "";
      cell.appendChild(el("div", `${h.kind} ${s.unit}`, "unit"));
      cell.appendChild(el("div", s.job || "free", s.job ? "job" : "dim"));
      cell.appendChild(el("div", s.job ? owner(s.who) : "", "who"));
      if (s.util !== null && s.util !== undefined) cell.appendChild(el("div", `${Math.round(100 * s.util)}%`, "dim"));
      slots.appendChild(cell);
    }
    card.appendChild(slots);
    for (const c of h.containers || []) {
      card.appendChild(el("div", `${c.name}: ${num(c.cpu, 2)} cores, ${num(c.mem / 1073741824, 2)} GiB`, "dim small"));
    }
    cards.push(card);
  }
  box.replaceChildren(...cards);
}

function renderOverview(doc) {
  document.getElementById("where").textContent = doc.inventory ? ` ${doc.inventory}` : "";
  document.getElementById("updated").textContent = doc.loading ? "looking at the hosts..." : `hosts looked at ${when(doc.time)}`;
  const errors = document.getElementById("errors");
  errors.replaceChildren(...(doc.errors || []).map(e => el("div", e)));
  renderHosts(doc);
  fill("jobs", doc.jobs.map(j => {
    const hosts = Object.entries(j.hosts).map(([h, x]) => x.units ? `${h} [${unitsText(x.units)}]` : h).join(", ");
    const tr = row([j.local ? jobLink(j.job) : j.job, owner(j.who), j.state, j.attempt, hosts, j.step,
                    num(j.rate, 2), num(j.loss, 4), num(j.tokens_per_s, 0), when(j.since)]);
    tr.dataset.job = j.job;
    tr.dataset.state = j.state;
    return tr;
  }), "no jobs");
  fill("queue", doc.queue.map(j => {
    const tr = row([j.queue.position, j.job, owner(j.who), when(j.since), j.queue.waits.join("; ")]);
    tr.dataset.job = j.job;
    return tr;
  }), "nobody waits");
  const cost = doc.cost || {};
  document.getElementById("cost").textContent =
    `looked every ${doc.refresh ? doc.refresh.every : "?"} s (last look ${doc.refresh ? doc.refresh.took : "-"} s); ` +
    `${cost.ssh_commands || 0} SSH commands in ${cost.refreshes || 0} looks since the dashboard started`;
}

function renderRuns(doc) {
  fill("runs", doc.runs.slice(0, 30).map(r => {
    const tr = row([jobLink(r.job), r.state, r.attempts, (r.hosts || []).join(", "), r.seconds, num(r.final_eval_loss, 4)]);
    tr.dataset.job = r.job;
    return tr;
  }), "no runs here yet");
}

const SVG = "http://www.w3.org/2000/svg";

function svgEl(tag, attrs, text) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
  if (text !== undefined) e.textContent = String(text);
  return e;
}

function drawChart(svg, points) {
  const W = 480, H = 220, L = 60, R = 10, T = 10, B = 30;
  svg.replaceChildren();
  svg.dataset.points = String(points.length);
  if (!points.length) {
    svg.appendChild(svgEl("text", {x: W / 2, y: H / 2, "text-anchor": "middle", class: "dim"}, "no step lines yet"));
    return;
  }
  const xs = points.map(p => p[0]), ys = points.map(p => p[1]);
  let x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y1 = y0 + Math.abs(y0 || 1) * 0.05; y0 = y0 - Math.abs(y0 || 1) * 0.05; }
  const sx = x => L + (x - x0) / (x1 - x0) * (W - L - R);
  const sy = y => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  svg.appendChild(svgEl("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis"}));
  svg.appendChild(svgEl("line", {x1: L, y1: T, x2: L, y2: H - B, class: "axis"}));
  svg.appendChild(svgEl("text", {x: L - 4, y: T + 10, "text-anchor": "end", class: "tick"}, num(y1, 4)));
  svg.appendChild(svgEl("text", {x: L - 4, y: H - B, "text-anchor": "end", class: "tick"}, num(y0, 4)));
  svg.appendChild(svgEl("text", {x: L, y: H - 8, class: "tick"}, `step ${x0}`));
  svg.appendChild(svgEl("text", {x: W - R, y: H - 8, "text-anchor": "end", class: "tick"}, `step ${x1}`));
  const line = points.map(p => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ");
  svg.appendChild(svgEl("polyline", {points: line, class: "curve"}));
  if (points.length === 1) svg.appendChild(svgEl("circle", {cx: sx(xs[0]), cy: sy(ys[0]), r: 3, class: "dot"}));
}

function renderJob(doc) {
  document.getElementById("job-title").textContent = doc.job;
  document.getElementById("job-summary").textContent =
    `${doc.state || "-"}; owner ${owner(doc.owner)}; ${doc.script || ""} ${(doc.args || []).join(" ")}` +
    (doc.record_error ? ` (record: ${doc.record_error})` : "");
  drawChart(document.getElementById("loss-chart"), doc.curves.loss);
  drawChart(document.getElementById("rate-chart"), doc.curves.tokens_per_s);
  fill("ranks", doc.newest.ranks.map(r => row([r.host, r.rank, r.step, num(r.loss, 4), num(r.tokens_per_s, 0),
                                               num(r.step_ms, 1), num(r.compute_ms, 1)])), "no step lines yet");
  fill("telemetry", Object.entries(doc.newest.hosts).map(([host, s]) => {
    const gpus = (s.gpus || []).map(g => `GPU ${g.index} ${g.util === null ? "-" : Math.round(100 * g.util) + "%"}`).join(", ");
    const conts = (s.containers || []).map(c => `${c.name} ${num(c.cpu, 2)} cores ${num(c.mem / 1073741824, 2)} GiB`).join(", ");
    const h = s.host || {};
    return row([host, gpus || "-", conts || "-", num(h.load1, 2), `${num(h.mem_used / 1073741824, 1)} / ${num(h.mem_total / 1073741824, 1)} GiB`]);
  }), "no telemetry");
  fill("attempts", doc.attempts.map(a => row([a.number, a.hosts.join(", "), when(a.started), when(a.ended), a.outcome])), "no attempts recorded");
  fill("failures", doc.failures.map(f => row([f.attempt, f.host, f.kind, f.detail])), "none");
  const logs = document.getElementById("logs");
  const boxes = [];
  for (const [host, lines] of Object.entries(doc.logs)) {
    const box = el("div", null, "log");
    box.dataset.host = host;
    box.appendChild(el("h4", host));
    box.appendChild(el("pre", lines.join("\n")));
    boxes.push(box);
  }
  logs.replaceChildren(...boxes);
  if (!boxes.length) logs.appendChild(el("p", "no logs yet", "dim"));
  const key = `${doc.job} ${doc.attempts.length}`;
  if (planFor !== key) {  // the plan is asked for when the job opens and when an attempt begins
    planFor = key;
    getJSON("/api/plan/" + encodeURIComponent(doc.job)).then(p => {
      document.getElementById("plan").textContent = p.plan || "no plan.txt";
    }).catch(() => { planFor = null; });
  }
}

function route() {
  const m = location.hash.match(/^#\/job\/(.+)$/);
  return m ? decodeURIComponent(m[1]) : null;
}

async function tick() {
  const job = route();
  document.getElementById("overview").hidden = job !== null;
  document.getElementById("job").hidden = job === null;
  try {
    const doc = await getJSON("/api/overview");
    if (job === null) {
      renderOverview(doc);
      renderRuns(await getJSON("/api/runs"));
    } else {
      document.getElementById("updated").textContent = `hosts looked at ${when(doc.time)}`;
      renderJob(await getJSON("/api/job/" + encodeURIComponent(job)));
    }
    document.body.dataset.error = "";
  } catch (e) {
    document.body.dataset.error = String(e.message || e);
    document.getElementById("updated").textContent = "the dashboard does not answer: " + String(e.message || e);
  }
}

function start() {
  if (timer) clearInterval(timer);
  tick();
  timer = setInterval(tick, POLL_MS);
}

window.addEventListener("hashchange", start);
document.addEventListener("DOMContentLoaded", start);
