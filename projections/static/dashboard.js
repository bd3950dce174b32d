// Tapeline dashboard: refreshes the server-rendered pages from the JSON API every few seconds and
// draws the charts as inline SVG. No build step, no libraries. Every value from the API is put in
// the page with textContent or an SVG attribute, never as HTML, so a reason containing markup
// shows as text.
"use strict";

const REFRESH_MS = 2000;
const SVG = "http://www.w3.org/2000/svg";
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2"];

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k.startsWith("data-")) node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(child ?? ""));
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function jobLink(jobId) {
  return el("a", {class: "job", href: "/jobs/" + encodeURIComponent(jobId)}, jobId);
}

async function getJSON(url) {
  const response = await fetch(url, {headers: {Accept: "application/json"}});
  if (!response.ok) throw new Error(url + ": HTTP " + response.status);
  return response.json();
}

// Replace a table body's rows, only when the data changed (no flicker, no lost selection).
function fillRows(tbody, rows, makeRow, emptyText, columns) {
  const key = JSON.stringify(rows);
  if (tbody.dataset.key === key) return;
  tbody.dataset.key = key;
  tbody.replaceChildren(...(rows.length ? rows.map(makeRow)
    : [el("tr", {class: "empty"}, el("td", {class: "muted", colSpan: columns}, emptyText))]));
}

function cells(...values) {
  return values.map(v => v instanceof Node ? el("td", {}, v) : el("td", {}, v === null || v === undefined ? "" : String(v)));
}

function num(v) { return el("td", {class: "num"}, v === null || v === undefined ? "" : String(v)); }

// Every term the dashboard shows gets its one-line explanation on hover: headings, states,
// outcomes, kinds, flags, event types and error classes (projections/glossary.py, embedded in the page).
const GLOSSARY = (() => {
  const node = document.getElementById("glossary");
  try { return node ? JSON.parse(node.dataset.terms) : {}; } catch (err) { return {}; }
})();

function explainTerms(root) {
  for (const node of root.querySelectorAll("th, td.state, td.outcome, td.kind, td.flags, td.event, td.error-class")) {
    const texts = node.textContent.split(",").map(t => t.trim()).filter(t => GLOSSARY[t])
      .map(t => t + ": " + GLOSSARY[t]);
    if (texts.length) {
      node.title = texts.join("\n");
      node.classList.add("term");
    }
  }
}

function stamp() {
  const where = document.getElementById("refreshed");
  if (where) where.textContent = "refreshed " + new Date().toISOString().slice(11, 19) + " UTC";
}

// --- charts ---------------------------------------------------------------------------------

function barChart(target, buckets) {
  const W = 720, H = 160, pad = 24, max = Math.max(1, ...buckets.map(b => b.created + b.completed + b.failed));
  const bw = (W - pad * 2) / Math.max(1, buckets.length);
  const nodes = [svg("line", {x1: pad, y1: H - pad, x2: W - pad, y2: H - pad, class: "axis"}),
                 svg("text", {x: 2, y: pad, class: "tick"}, String(max)),
                 svg("text", {x: pad, y: H - 6, class: "tick"}, "-60 min"),
                 svg("text", {x: W - pad - 24, y: H - 6, class: "tick"}, "now")];
  buckets.forEach((b, i) => {
    let y = H - pad;
    for (const kind of ["completed", "failed", "created"]) {
      const h = (H - pad * 2) * b[kind] / max;
      if (h > 0) {
        y -= h;
        const bar = svg("rect", {x: pad + i * bw + 1, y: y, width: Math.max(1, bw - 2), height: h, class: "bar " + kind});
        bar.append(svg("title", {}, b.minute.slice(11, 16) + " UTC: " + b[kind] + " " + kind));
        nodes.push(bar);
      }
    }
  });
  target.replaceChildren(...nodes);
}

function progressChart(target, legend, doc) {
  const W = 720, H = 240, left = 48, right = 16, top = 12, bottom = 28;
  const series = doc.series.filter(s => s.stage === "transcode" && s.points.some(p => p.t_s !== null));
  const maxT = Math.max(1, ...series.flatMap(s => s.points.map(p => p.t_s || 0)));
  const maxY = Math.max(1, doc.source_duration_s || 0, ...series.flatMap(s => s.points.map(p => p.media_s || 0)));
  const x = t => left + (W - left - right) * t / maxT;
  const y = v => H - bottom - (H - top - bottom) * v / maxY;
  const nodes = [svg("line", {x1: left, y1: H - bottom, x2: W - right, y2: H - bottom, class: "axis"}),
                 svg("line", {x1: left, y1: top, x2: left, y2: H - bottom, class: "axis"}),
                 svg("text", {x: 2, y: top + 10, class: "tick"}, maxY.toFixed(1) + " s"),
                 svg("text", {x: 2, y: H - bottom, class: "tick"}, "0"),
                 svg("text", {x: W - right - 60, y: H - 8, class: "tick"}, maxT.toFixed(1) + " s")];
  if (doc.source_duration_s) {
    nodes.push(svg("line", {x1: left, y1: y(doc.source_duration_s), x2: W - right, y2: y(doc.source_duration_s),
                            class: "target"}));
  }
  const keys = [];
  series.forEach((s, i) => {
    const color = COLORS[i % COLORS.length];
    const points = s.points.filter(p => p.t_s !== null).map(p => x(p.t_s).toFixed(1) + "," + y(p.media_s || 0).toFixed(1));
    const line = svg("polyline", {points: points.join(" "), fill: "none", stroke: color, "stroke-width": 2,
                                  class: "series", "data-attempt": s.attempt});
    line.append(svg("title", {}, "attempt " + s.attempt + ": " + (s.outcome || "?")));
    nodes.push(line);
    // A dot per heartbeat, so an attempt with a single heartbeat is drawn too.
    for (const p of s.points.filter(p => p.t_s !== null)) {
      nodes.push(svg("circle", {cx: x(p.t_s).toFixed(1), cy: y(p.media_s || 0).toFixed(1), r: 2.5, fill: color,
                                class: "point" + (p.superseded ? " superseded" : ""), "data-attempt": s.attempt}));
    }
    // The attempts table's count (applied heartbeats); a fenced zombie's late ones are named apart.
    const late = s.points.filter(p => p.superseded).length;
    keys.push(el("span", {class: "series-key", "data-attempt": String(s.attempt)},
                 el("span", {class: "swatch", style: "background:" + color}),
                 "attempt " + s.attempt + " (" + (s.outcome || "?") + ", " + s.heartbeats + " heartbeats" +
                 (late ? ", " + late + " late (superseded)" : "") + ")"));
  });
  if (!series.length) {  // "yet" only while the job can still run
    const active = ["accepted", "queued", "running", "retry_scheduled"].includes(doc.state);
    nodes.push(svg("text", {x: left + 10, y: H / 2, class: "tick"},
                   active ? "no heartbeats yet" : "no transcode heartbeats recorded"));
  }
  target.replaceChildren(...nodes);
  legend.replaceChildren(...keys);
}

// --- pages ----------------------------------------------------------------------------------

function jobRow(j, withPriority) {
  const tds = [el("td", {}, jobLink(j.job_id)), el("td", {class: "state " + j.state}, j.state), el("td", {}, j.stage)];
  if (withPriority) tds.push(el("td", {}, j.priority || ""));
  tds.push(el("td", {}, String(j.attempt)), num(j.percent_text), el("td", {}, (j.updated_at || "").slice(0, 19)),
           el("td", {}, j.reason || ""));
  return el("tr", {"data-job-id": j.job_id, "data-state": j.state}, ...tds);
}

const pages = {
  async overview() {
    const doc = await getJSON("/api/overview");
    fillRows(document.querySelector("#by-state tbody"), Object.entries(doc.jobs_by_state),
             ([state, n]) => el("tr", {"data-state": state}, el("th", {}, state), num(n)), "no jobs", 2);
    const stageRows = Object.entries(doc.jobs_by_stage).flatMap(([stage, counts]) =>
      Object.entries(counts).map(([state, n]) => [stage, state, n]));
    fillRows(document.querySelector("#by-stage tbody"), stageRows,
             ([stage, state, n]) => el("tr", {}, ...cells(stage, state), num(n)), "no jobs", 3);
    const waiting = doc.stalls.waiting || 0;
    document.getElementById("stalled-count").textContent =
      String(Object.values(doc.stalls).reduce((a, b) => a + b, 0) - waiting);
    document.getElementById("waiting-count").textContent = String(waiting);
    document.getElementById("suspect-count").textContent = String(doc.suspect);
    document.getElementById("dead-pending").textContent = String(doc.dead_letters.pending);
    const lag = doc.projection_lag;
    document.getElementById("lag").textContent = lag.error ? "unknown" : lag.events + " events, " + lag.seconds + " s";
    const region = doc.region_replication, card = document.getElementById("region-replication");
    if (region && card) {
      card.dataset.state = region.state;
      document.getElementById("region-text").textContent = region.text;
      const rows = region.rows.map(r => el("tr", r.over ? {class: "over"} : {}, el("th", {}, r.name), num(r.value)));
      document.querySelector("#region-rows tbody").replaceChildren(...rows);
    }
    fillRows(document.querySelector("#recent-jobs tbody"), doc.recent_jobs, j => jobRow(j, false), "no jobs", 7);
    barChart(document.getElementById("throughput"), doc.throughput);
  },

  async jobs() {
    const doc = await getJSON("/api/jobs" + window.location.search);
    fillRows(document.querySelector("#jobs tbody"), doc.jobs, j => jobRow(j, true), "no jobs match", 8);
  },

  async stalled() {
    const rows = await getJSON("/api/stalled");
    fillRows(document.querySelector("#stalls tbody"), rows, s => el("tr", {"data-job-id": s.job_id, "data-kind": s.kind},
      el("td", {class: "kind"}, s.kind), el("td", {}, jobLink(s.job_id)), ...cells(s.stage, s.attempt, s.worker || "",
      (s.last_progress_at || "").slice(0, 19)), num(s.since_s.toFixed(1)), el("td", {}, s.reason || "")),
      "nothing is stalled, suspect, or judged stalled recently", 8);
  },

  async "dead-letters"() {
    const rows = await getJSON("/api/dead-letters");
    fillRows(document.querySelector("#dead-letters tbody"), rows, d => el("tr", {"data-id": d.id, "data-kind": d.kind},
      el("td", {class: "id"}, d.id), el("td", {class: "kind"}, d.kind), el("td", {}, d.job_id ? jobLink(d.job_id) : ""),
      el("td", {}, d.stage || ""), el("td", {class: "error-class"}, d.error_class || ""),
      el("td", {}, d.attempts ? d.attempts_text : ""),  // tapeline/rows.py attempts_text: the CLI's words
      ...cells((d.broker_ts || "").slice(0, 19)),
      el("td", {class: "error"}, d.error || ""),
      el("td", {class: "replayed"}, d.replayed_at ? "by " + d.replayed_by + ": " + (d.replay_reason || "") : "no")),
      "no dead letters", 9);
  },

  async job() {
    const jobId = document.body.dataset.jobId;
    const base = "/api/jobs/" + encodeURIComponent(jobId);
    const [detail, events, progress] = await Promise.all([getJSON(base), getJSON(base + "/timeline"),
                                                          getJSON(base + "/progress")]);
    const job = detail.job;
    const state = document.getElementById("job-state");
    state.textContent = job.state;
    state.className = "state " + job.state;
    document.getElementById("job-stage").textContent = job.stage + " / " + job.attempt;  // the stage's own attempt
    document.getElementById("job-percent").textContent = job.percent_text;  // presenter.percent_text, as the CLI prints it
    document.getElementById("job-reason").textContent = job.reason || "";
    document.getElementById("job-error-class").textContent = job.error_class || "";
    document.getElementById("job-updated").textContent = (job.updated_at || "").slice(0, 23);
    const master = document.getElementById("job-master");
    if (job.master_url && !master.firstChild) master.append(el("a", {href: job.master_url}, job.master_url));
    fillRows(document.querySelector("#attempts tbody"), detail.attempts, a => el("tr", {"data-outcome": a.outcome},
      ...cells(a.stage, a.attempt, a.worker || ""), el("td", {class: "outcome " + a.outcome}, a.outcome),
      el("td", {class: "error-class"}, a.error_class || ""), ...cells((a.started_at || "").slice(11, 23)),
      num(a.duration_s), num(a.wasted_s),
      num(a.heartbeats)), "no attempts yet", 9);
    fillRows(document.querySelector("#timeline tbody"), events, e => el("tr", {"data-event": e.event_type},
      ...cells(e.broker_ts.slice(11, 23)), el("td", {class: "event"}, e.event_type), ...cells(e.stage, e.attempt),
      el("td", {class: "flags"}, e.flags.join(",")),
      el("td", {class: "detail"}, e.detail || "")), "no events", 6);
    progressChart(document.getElementById("progress-chart"), document.getElementById("progress-legend"), progress);
  },
};

// The active problems strip on top of every page (projections/problems.py, GET /api/problems): the
// same lines the server rendered, redrawn only when they changed.
async function refreshProblems() {
  const strip = document.getElementById("problems");
  if (!strip) return;
  const data = await getJSON("/api/problems");
  const key = JSON.stringify(data);
  if (strip.dataset.key === key) return;
  strip.dataset.key = key;
  const lines = data.problems.map(p => {
    const line = el("p", {class: "problem", "data-kind": p.kind, "data-count": String(p.count)},
      el("a", {class: "problem-link", href: p.href}, p.text));
    if (p.jobs.length) {
      line.append(": ");
      p.jobs.forEach((job, i) => {
        if (i) line.append(", ");
        line.append(el("a", {class: "problem-job", href: job.href}, job.job_id));
      });
      if (p.count > p.jobs.length) line.append(" and more");
    }
    return line;
  });
  if (data.error) lines.unshift(el("p", {class: "problem unreadable"}, data.error));
  strip.replaceChildren(...lines);
  strip.hidden = lines.length === 0;
}

async function refresh(page) {
  try {
    await Promise.all([pages[page](), refreshProblems()]);
    explainTerms(document);
    stamp();
    document.body.dataset.refreshes = String(Number(document.body.dataset.refreshes || 0) + 1);
  } catch (err) {
    const where = document.getElementById("refreshed");
    if (where) where.textContent = "refresh failed: " + err.message;
  }
}

document.addEventListener("DOMContentLoaded", () => {
  explainTerms(document);
  const page = document.body.dataset.page;
  if (!pages[page]) return;
  refresh(page);
  setInterval(() => { if (!document.hidden) refresh(page); }, REFRESH_MS);
});
