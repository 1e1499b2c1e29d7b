// Keratin dashboard: polls the broker's JSON API every 2 s and redraws. Plain DOM, no
// framework and no network beyond this origin. Every value from the API is set with
// textContent or an SVG attribute, never parsed as HTML (queue and stream names are user input).
//
// Branches of the API may lack a route (404) or a field: each section renders what it has and
// says plainly what is missing.
"use strict";

const POLL_MS = 2000;
const REQUEST_TIMEOUT_MS = 5000;
const SVG_NS = "http://www.w3.org/2000/svg";
const LEVELS = ["normal", "soft", "hard", "reserve"];
const LEVEL_TEXT = {
  normal: "publishing at full speed",
  soft: "publishers are slowed and spare files released",
  hard: "publishes are refused until consumers free space",
  reserve: "publishes are refused; only writes that free space go on",
};
const ATTENTION_HISTORY_MAX = 50;

// --- small helpers -------------------------------------------------------------------------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null) continue;
    if (key === "class") node.className = value;
    else node.setAttribute(key, String(value));
  }
  for (const child of children) {
    if (child === undefined || child === null) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function svg(tag, attrs) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
  return node;
}

function isNumber(value) {
  return typeof value === "number" && Number.isFinite(value);
}

function bytes(value) {
  if (!isNumber(value)) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
  let n = value;
  let unit = 0;
  while (Math.abs(n) >= 1024 && unit < units.length - 1) {
    n /= 1024;
    unit += 1;
  }
  return unit === 0 ? `${n} B` : `${n.toFixed(n < 10 ? 2 : 1)} ${units[unit]}`;
}

function count(value) {
  return isNumber(value) ? value.toLocaleString("en-US") : "–";
}

function percent(part, whole) {
  return isNumber(part) && isNumber(whole) && whole > 0 ? `${((100 * part) / whole).toFixed(1)}%` : "";
}

function levelOf(value) {
  return LEVELS.includes(value) ? value : "normal";
}

function clock(ms) {
  if (!isNumber(ms)) return "–";
  const d = new Date(ms);
  const sameDay = new Date().toDateString() === d.toDateString();
  const time = d.toLocaleTimeString("en-GB", { hour12: false });
  return sameDay ? time : `${d.toISOString().slice(0, 10)} ${time}`;
}

function replace(container, ...children) {
  container.replaceChildren(...children.filter((c) => c !== null && c !== undefined));
}

// Fetch JSON; resolves to {ok, status, body} and never rejects, so one failing route does not
// blank the others.
async function getJson(path) {
  const controller = new AbortController();
  const timer = setTimeout(() => controller.abort(), REQUEST_TIMEOUT_MS);
  try {
    const response = await fetch(path, { signal: controller.signal, cache: "no-store", headers: authHeaders() });
    if (response.status === 401) needLogin();
    if (!response.ok) return { ok: false, status: response.status, body: null };
    return { ok: true, status: response.status, body: await response.json() };
  } catch (error) {
    return { ok: false, status: 0, body: null, error: String(error) };
  } finally {
    clearTimeout(timer);
  }
}

// --- storage ---------------------------------------------------------------------------------

function renderFilesystems(status) {
  const container = document.getElementById("filesystems");
  const list = Array.isArray(status.filesystems) ? status.filesystems : [];
  if (list.length === 0) {
    replace(container, el("p", { class: "empty" }, "No storage file systems reported."));
    return;
  }
  replace(container, ...list.map((fs, index) => filesystemCard(fs, index)));
}

// The projection at the recent fill rate (null while free space is flat or growing); never
// what limits publishes, which only levels do.
function timeToFullText(projection) {
  if (!projection) return "not filling";
  const rate = `${bytes(projection.fill_bytes_per_s)}/s`;
  return `hard in ${duration(projection.to_hard_ms)}, reserve in ${duration(projection.to_reserve_ms)} (filling at ${rate})`;
}

function duration(ms) {
  if (!isNumber(ms)) return "?";
  const s = Math.floor(ms / 1000);
  if (s < 120) return `${s} s`;
  if (s < 7200) return `${Math.floor(s / 60)} min`;
  if (s < 172800) return `${(s / 3600).toFixed(1)} h`;
  return `${Math.floor(s / 86400)} d`;
}

function filesystemCard(fs, index) {
  const level = levelOf(fs.level);
  const banner = el(
    "div",
    { id: `fs-banner-${index}`, class: `banner level-${level}`, "data-level": level, role: "status" },
    el("span", { class: "level" }, level),
    el("span", { class: "what" }, `${bytes(fs.free_bytes)} free`),
    el("span", { class: "why" }, LEVEL_TEXT[level]),
    el("span", { class: "path", title: `device ${fs.device}` }, fs.path ?? "?"),
  );
  const t = fs.thresholds || {};
  const figures = el(
    "dl",
    { class: "figures" },
    el("dt", {}, "Free"),
    el("dd", { id: `fs-free-${index}` }, `${bytes(fs.free_bytes)} of ${bytes(fs.total_bytes)} (${percent(fs.free_bytes, fs.total_bytes)})`),
    el("dt", {}, "Spare files"),
    el("dd", {}, `${bytes(fs.spare_bytes)} (counted as free)`),
    el("dt", {}, "Soft below"),
    el("dd", {}, bytes(t.soft_bytes)),
    el("dt", {}, "Hard below"),
    el("dd", {}, bytes(t.hard_bytes)),
    el("dt", {}, "Reserve below"),
    el("dd", {}, bytes(t.reserve_bytes)),
    el("dt", {}, "Time to full"),
    el("dd", { id: `fs-time-to-full-${index}` }, timeToFullText(fs.time_to_full)),
  );
  const top = Array.isArray(fs.top_queues) ? fs.top_queues : null;
  let topList;
  if (top === null) topList = el("p", { class: "empty" }, "Not reported by this broker.");
  else if (top.length === 0) topList = el("p", { class: "empty" }, "No queue or stream stores data on this file system.");
  else
    topList = el(
      "ol",
      { class: "top-queues" },
      ...top.map((q) =>
        el("li", {}, el("span", { class: "name" }, q.kind === "stream" ? `${q.name ?? "?"} (stream)` : (q.name ?? "?")), el("span", {}, bytes(q.disk_bytes))),
      ),
    );
  const left = el("div", {}, figures, el("div", { class: "subhead" }, "Largest queues and streams here"), topList);
  const right = el("div", {}, plot(fs));
  return el("article", { class: "card", "data-path": fs.path ?? "" }, banner, el("div", { class: "fs-body" }, left, right));
}

// Free space over time, thresholds as dashed lines. The x axis ends at the newest point and
// spans at least a minute. The y axis starts at 0 and ends a quarter above the larger of the
// highest point and the soft threshold (never above the size), so the thresholds and the line
// stay apart even when free space is a small part of a large file system.
function plot(fs) {
  const width = 520;
  const height = 160;
  const pad = { left: 62, right: 8, top: 8, bottom: 18 };
  const inner = { w: width - pad.left - pad.right, h: height - pad.top - pad.bottom };
  const root = svg("svg", {
    class: "plot",
    viewBox: `0 0 ${width} ${height}`,
    role: "img",
    "aria-label": `free space on ${fs.path ?? "?"} over the last minutes`,
  });
  root.append(svg("rect", { class: "frame", x: pad.left, y: pad.top, width: inner.w, height: inner.h }));
  const points = (Array.isArray(fs.history) ? fs.history : []).filter(
    (p) => Array.isArray(p) && isNumber(p[0]) && isNumber(p[1]),
  );
  const t = fs.thresholds || {};
  const highest = Math.max(isNumber(t.soft_bytes) ? t.soft_bytes : 0, ...points.map((p) => p[1]), 1);
  const top = isNumber(fs.total_bytes) && fs.total_bytes > 0 ? Math.min(fs.total_bytes, highest * 1.25) : highest * 1.25;
  const y = (value) => pad.top + inner.h - (inner.h * Math.min(Math.max(value, 0), top)) / top;
  const label = (text, x, yy, anchor) => {
    const node = svg("text", { x, y: yy, "text-anchor": anchor || "end" });
    node.textContent = text;
    root.append(node);
  };
  label(bytes(top), pad.left - 4, pad.top + 8);
  label(bytes(top / 2), pad.left - 4, pad.top + inner.h / 2 + 4);
  label("0", pad.left - 4, pad.top + inner.h);
  const legend = el("div", { class: "legend" }, el("span", { class: "key free" }, "free"));
  for (const name of ["soft", "hard", "reserve"]) {
    const value = t[`${name}_bytes`];
    if (!isNumber(value)) continue;
    const yy = y(value);
    root.append(svg("line", { class: `threshold ${name}`, x1: pad.left, x2: pad.left + inner.w, y1: yy, y2: yy }));
    legend.append(el("span", { class: `key ${name}` }, `${name} ${bytes(value)}`));
  }
  const figure = el("figure", { class: "plot-figure" }, root, legend);
  if (points.length === 0) {
    label("no samples yet", pad.left + inner.w / 2, pad.top + inner.h / 2, "middle");
    return figure;
  }
  const last = points[points.length - 1][0];
  const first = Math.min(points[0][0], last - 60_000);
  const span = Math.max(last - first, 1);
  const x = (ms) => pad.left + (inner.w * (ms - first)) / span;
  const coords = points.map((p) => `${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`);
  if (points.length === 1) coords.unshift(`${pad.left},${y(points[0][1]).toFixed(1)}`);
  const base = (pad.top + inner.h).toFixed(1);
  const startX = coords[0].split(",")[0];
  const endX = coords[coords.length - 1].split(",")[0];
  root.append(svg("polygon", { class: "area", points: `${startX},${base} ${coords.join(" ")} ${endX},${base}` }));
  root.append(svg("polyline", { class: "free", points: coords.join(" ") }));
  const minutes = Math.round(span / 60_000);
  label(minutes >= 1 ? `−${minutes} min` : `−${Math.round(span / 1000)} s`, pad.left, height - 4, "start");
  label("now", pad.left + inner.w, height - 4);
  return figure;
}

// --- memory ----------------------------------------------------------------------------------

function renderMemory(status) {
  const container = document.getElementById("memory");
  const memory = status.memory;
  if (!memory) {
    replace(container, el("p", { class: "empty" }, "Not reported by this broker."));
    return;
  }
  const level = levelOf(memory.level);
  const fraction = isNumber(memory.resident_bytes) && memory.limit_bytes > 0 ? memory.resident_bytes / memory.limit_bytes : 0;
  const bar = el("span", {});
  // CSSOM, not a style attribute: the Content-Security-Policy allows no inline styles.
  bar.style.width = `${Math.min(100, fraction * 100).toFixed(1)}%`;
  replace(
    container,
    el(
      "article",
      { class: "card" },
      el(
        "div",
        { id: "memory-banner", class: `banner level-${level}`, "data-level": level, role: "status" },
        el("span", { class: "level" }, level),
        el("span", { class: "what" }, `${bytes(memory.resident_bytes)} resident of ${bytes(memory.limit_bytes)}`),
        el("span", { class: "why" }, LEVEL_TEXT[level]),
        el("span", { class: "path" }, `limit from ${memory.limit_source ?? "?"}`),
      ),
      el(
        "div",
        { class: "fs-body" },
        el("div", {}, el("div", { class: `meter level-${level}` }, bar), el("div", { class: "subhead" }, `${percent(memory.resident_bytes, memory.limit_bytes)} of the limit`)),
      ),
    ),
  );
}

// --- cluster ---------------------------------------------------------------------------------

// The worst level a node's last report names (its file systems and memory), or null unheard.
function worstLevel(levels) {
  if (!levels) return null;
  const all = (Array.isArray(levels.filesystems) ? levels.filesystems : []).map((fs) => levelOf(fs.level));
  if (levels.memory) all.push(levelOf(levels.memory.level));
  return all.reduce((worst, level) => (LEVELS.indexOf(level) > LEVELS.indexOf(worst) ? level : worst), "normal");
}

function heardText(node) {
  return isNumber(node.levels_age_ms) ? `${(node.levels_age_ms / 1000).toFixed(1)} s ago` : "not heard yet";
}

// One row per node: reachable or not from here, the partitions it leads against those it is
// the preferred leader of, its worst level, where its clients and its dashboard are.
function renderClusterNodes(cluster, nodes) {
  const summary = document.getElementById("cluster-summary");
  const parts = [];
  if (cluster.name) parts.push(`Cluster ${cluster.name}, seen from node ${cluster.node_id ?? "?"}`);
  if (isNumber(cluster.partitions)) parts.push(`${count(cluster.partitions)} partitions`);
  if (isNumber(cluster.leaderless) && cluster.leaderless > 0) parts.push(`${count(cluster.leaderless)} with no known leader`);
  summary.textContent = parts.join(" · ");
  const rows = nodes.map((node) => {
    const state = node.removed ? "removed" : node.reachable === false ? "unreachable" : "reachable";
    const names = [`node ${node.id ?? "?"}`];
    if (node.this_node) names.push("(this node)");
    if (node.meta_leader) names.push("· metadata leader");
    const worst = worstLevel(node.levels);
    const admin = node.admin_addr && !node.this_node ? el("a", { href: `http://${node.admin_addr}/` }, node.admin_addr) : node.this_node ? "this page" : "–";
    return el(
      "tr",
      { "data-node": String(node.id ?? "?"), "data-state": state },
      el("td", { class: "name" }, names.join(" ")),
      el("td", { class: `state state-${state}` }, state),
      el("td", { class: "num", "data-leads": String(node.leads ?? 0) }, isNumber(node.leads) ? count(node.leads) : "–"),
      el("td", { class: "num" }, isNumber(node.preferred) ? count(node.preferred) : "–"),
      // An unreachable or removed node's level is its last report's: shown, but greyed.
      worst
        ? el("td", { "data-level": worst }, state === "reachable" ? el("span", { class: `badge level-${worst}` }, worst) : el("span", { class: "badge quiet" }, `${worst} when last heard`))
        : el("td", {}, "–"),
      el("td", { class: "name" }, node.client_addr ?? "–"),
      el("td", {}, admin),
      el("td", {}, node.this_node ? "now" : heardText(node)),
    );
  });
  replace(document.querySelector("#cluster-nodes tbody"), ...rows);
}

// On a cluster node the status carries every node: an overview row each (above), then one
// banner per node and file system as its label last reported them, with the largest queues
// there, and one for its memory.
function renderCluster(status) {
  const section = document.getElementById("cluster-section");
  const nodes = Array.isArray(status.cluster?.nodes) ? status.cluster.nodes : null;
  if (nodes === null) {
    section.hidden = true;
    return;
  }
  section.hidden = false;
  renderClusterNodes(status.cluster, nodes);
  const cards = [];
  for (const node of nodes) {
    const heard = isNumber(node.levels_age_ms) ? `heard ${(node.levels_age_ms / 1000).toFixed(1)} s ago` : "not heard yet";
    const levels = node.levels || {};
    const resources = (Array.isArray(levels.filesystems) ? levels.filesystems : []).map((fs) => ({
      what: fs.path ?? "?",
      level: levelOf(fs.level),
      figures: `${bytes((fs.free_bytes ?? 0) + (fs.spare_bytes ?? 0))} free of ${bytes(fs.total_bytes)}`,
      largest: Array.isArray(fs.largest_queues) ? fs.largest_queues : [],
    }));
    if (levels.memory)
      resources.push({
        what: "memory",
        level: levelOf(levels.memory.level),
        figures: `${bytes(levels.memory.resident_bytes)} resident of ${bytes(levels.memory.limit_bytes)}`,
      });
    if (resources.length === 0) resources.push({ what: "no report yet", level: "normal", figures: "" });
    for (const resource of resources)
      cards.push(
        el(
          "article",
          { class: "card", "data-node": String(node.id ?? "?"), "data-path": resource.what },
          el(
            "div",
            { class: `banner level-${resource.level}`, "data-level": resource.level, role: "status" },
            el("span", { class: "level" }, resource.level),
            el("span", { class: "what" }, `node ${node.id ?? "?"}: ${resource.figures}`),
            el("span", { class: "why" }, LEVEL_TEXT[resource.level]),
            el("span", { class: "path" }, `${resource.what} (${heard})`),
          ),
          ...(resource.largest && resource.largest.length
            ? [
                el(
                  "p",
                  { class: "largest" },
                  "Largest queues here: ",
                  resource.largest.map((q) => `${q.queue ?? "?"} ${bytes(q.bytes)}`).join(", "),
                ),
              ]
            : []),
        ),
      );
  }
  replace(document.getElementById("cluster"), ...cards);
}

// --- queues ----------------------------------------------------------------------------------

function limitsText(settings) {
  const s = settings || {};
  const parts = [];
  if (isNumber(s.max_messages)) parts.push(`${count(s.max_messages)} msgs`);
  if (isNumber(s.max_bytes)) parts.push(bytes(s.max_bytes));
  if (parts.length && s.overflow) parts.push(s.overflow === "drop_oldest" ? "drop oldest" : "reject");
  return parts.length ? parts.join(", ") : "none";
}

function renderQueues(result) {
  const body = document.querySelector("#queues tbody");
  const columns = 7;
  if (!result.ok) {
    replace(body, el("tr", {}, el("td", { colspan: columns, class: "error" }, `Queues unavailable (${result.status || "no answer"}).`)));
    return;
  }
  const queues = Array.isArray(result.body.queues) ? [...result.body.queues] : [];
  if (queues.length === 0) {
    replace(body, el("tr", {}, el("td", { colspan: columns, class: "empty" }, "No queues.")));
    return;
  }
  queues.sort((a, b) => String(a.name).localeCompare(String(b.name)));
  replace(
    body,
    ...queues.map((q) => {
      const stopped = (q.partitions || []).filter((p) => p.stopped).length;
      const state = q.full
        ? el("span", { class: "badge bad" }, "full")
        : stopped > 0
          ? el("span", { class: "badge bad" }, `${stopped} log stopped`)
          : el("span", { class: "badge" }, "ok");
      return el(
        "tr",
        { "data-queue": q.name ?? "" },
        el("td", { class: "name" }, q.name ?? "?"),
        el("td", { class: "num" }, count(q.ready)),
        el("td", { class: "num" }, count(q.inflight)),
        el("td", { class: "num" }, bytes(q.bytes)),
        el("td", { class: "num" }, bytes(q.disk_bytes)),
        el("td", {}, limitsText(q.settings)),
        el("td", {}, state),
      );
    }),
  );
}

// --- streams ---------------------------------------------------------------------------------

function retentionText(settings) {
  const s = settings || {};
  const parts = [];
  if (isNumber(s.max_bytes)) parts.push(bytes(s.max_bytes));
  if (isNumber(s.max_age_ms)) parts.push(duration(s.max_age_ms));
  if (isNumber(s.max_messages)) parts.push(`${count(s.max_messages)} msgs`);
  return parts.length ? parts.join(", ") : "none";
}

// The age of the oldest message held, "–" when the stream holds none.
function oldestText(oldestMs) {
  return isNumber(oldestMs) ? duration(Math.max(0, Date.now() - oldestMs)) : "–";
}

function renderStreams(result) {
  const body = document.querySelector("#streams tbody");
  const columns = 7;
  if (!result.ok) {
    replace(body, el("tr", {}, el("td", { colspan: columns, class: "error" }, `Streams unavailable (${result.status || "no answer"}).`)));
    return;
  }
  const streams = Array.isArray(result.body.streams) ? [...result.body.streams] : [];
  if (streams.length === 0) {
    replace(body, el("tr", {}, el("td", { colspan: columns, class: "empty" }, "No streams.")));
    return;
  }
  streams.sort((a, b) => String(a.name).localeCompare(String(b.name)));
  replace(
    body,
    ...streams.map((s) =>
      el(
        "tr",
        { "data-stream": s.name ?? "" },
        el("td", { class: "name" }, s.name ?? "?"),
        el("td", { class: "num" }, count((s.settings || {}).partitions)),
        el("td", { class: "num" }, count(s.messages)),
        el("td", { class: "num" }, bytes(s.disk_bytes)),
        el("td", {}, retentionText(s.settings)),
        el("td", { class: "num" }, oldestText(s.oldest_timestamp_ms)),
        el("td", { class: "num" }, count(s.cursor_count)),
      ),
    ),
  );
}

// --- attention -------------------------------------------------------------------------------

// Items come as {id, kind, subject, severity, message, raised_at_ms, cleared_at_ms, active} or,
// from older brokers, {at_ms, message} (shown as history: such brokers never clear them).
function renderAttention(result) {
  const container = document.getElementById("attention");
  if (!result.ok) {
    replace(container, el("div", { class: "card" }, el("p", { class: "error" }, `Attention items unavailable (${result.status || "no answer"}).`)));
    return;
  }
  const items = (Array.isArray(result.body.items) ? result.body.items : []).map((item) => ({
    active: item.active === true,
    at: isNumber(item.raised_at_ms) ? item.raised_at_ms : item.at_ms,
    cleared: item.cleared_at_ms,
    severity: item.severity,
    kind: item.kind,
    subject: item.subject,
    message: item.message ?? "",
  }));
  const newestFirst = (a, b) => (b.at || 0) - (a.at || 0);
  const active = items.filter((i) => i.active).sort(newestFirst);
  const history = items.filter((i) => !i.active).sort(newestFirst).slice(0, ATTENTION_HISTORY_MAX);
  const row = (item) => {
    const badge = item.active
      ? el("span", { class: item.severity === "critical" || item.severity === "error" ? "badge bad" : "badge warn" }, item.severity || "active")
      : el("span", { class: "badge quiet" }, isNumber(item.cleared) ? `cleared ${clock(item.cleared)}` : item.kind || "event");
    return el(
      "li",
      { class: item.active ? "active" : "cleared" },
      el("span", { class: "when" }, clock(item.at)),
      el("span", {}, badge),
      el("span", { class: "message" }, item.message),
    );
  };
  const card = el("div", { class: "card" });
  if (active.length === 0) card.append(el("p", { class: "empty", id: "attention-none" }, "Nothing needs attention now."));
  else card.append(el("ul", { class: "items", id: "attention-active" }, ...active.map(row)));
  if (history.length > 0) {
    card.append(el("div", { class: "subhead empty" }, "Recent history"));
    card.append(el("ul", { class: "items", id: "attention-history" }, ...history.map(row)));
  }
  replace(container, card);
}

// --- settings --------------------------------------------------------------------------------

function renderSettings(result) {
  const container = document.getElementById("settings");
  if (!result.ok) {
    const why = result.status === 404 ? "This broker has no runtime settings API (GET /api/v1/settings)." : `Settings unavailable (${result.status || "no answer"}).`;
    replace(container, el("div", { class: "card" }, el("p", { class: "empty" }, why)));
    return;
  }
  const all = Array.isArray(result.body.settings) ? result.body.settings : [];
  // The limits and every other setting that changes live (the storage budgets).
  const limits = all.filter((s) => String(s.key).startsWith("limits.") || s.live === true);
  if (limits.length === 0) {
    replace(container, el("div", { class: "card" }, el("p", { class: "empty" }, "No limit settings reported.")));
    return;
  }
  const rows = limits.map((s) =>
    el(
      "tr",
      { "data-key": s.key },
      el("td", { class: "name" }, s.key),
      el("td", { class: "num" }, s.value === null || s.value === undefined ? "–" : typeof s.value === "object" ? JSON.stringify(s.value) : String(s.value)),
      el("td", {}, s.origin === "runtime" && s.configured_value !== undefined ? `runtime (configured ${s.configured_value === null ? "unset" : JSON.stringify(s.configured_value)}, ${s.configured_origin ?? "?"})` : s.origin ?? "?"),
      el("td", {}, s.live === false ? el("span", { class: "badge quiet" }, "restart") : el("span", { class: "badge" }, "live")),
    ),
  );
  const table = el(
    "table",
    { class: "grid", id: "settings-table" },
    el("thead", {}, el("tr", {}, el("th", {}, "Key"), el("th", { class: "num" }, "Value"), el("th", {}, "From"), el("th", {}, "Applies"))),
    el("tbody", {}, ...rows),
  );
  replace(container, el("div", { class: "table-wrap" }, table));
}

// The deepest level of any file system or memory, for the window title.
function worstLevel(status) {
  const levels = [...(status.filesystems || []).map((fs) => fs.level), status.memory?.level].map(levelOf);
  return levels.reduce((worst, level) => (LEVELS.indexOf(level) > LEVELS.indexOf(worst) ? level : worst), "normal");
}

// --- login -----------------------------------------------------------------------------------
// A broker with logins (server.auth = users) answers 401 until the page logs in: the form asks
// for a user and password once, trades them for a session token (POST /api/v1/login) kept in
// this tab's sessionStorage, and sends that token as Bearer from then on. The password itself
// is never stored.

const SESSION_KEY = "keratin-session";

function authHeaders() {
  const token = sessionStorage.getItem(SESSION_KEY);
  return token ? { Authorization: `Bearer ${token}` } : {};
}

function needLogin() {
  sessionStorage.removeItem(SESSION_KEY);
  document.getElementById("login").hidden = false;
  document.getElementById("main").hidden = true;
  document.getElementById("who").hidden = true;
  document.getElementById("logout").hidden = true;
}

async function logIn(event) {
  event.preventDefault();
  const user = document.getElementById("login-user").value;
  const password = document.getElementById("login-password").value;
  const error = document.getElementById("login-error");
  error.hidden = true;
  try {
    const basic = btoa(unescape(encodeURIComponent(`${user}:${password}`)));
    const response = await fetch("/api/v1/login", { method: "POST", cache: "no-store", headers: { Authorization: `Basic ${basic}` } });
    const body = await response.json().catch(() => ({}));
    if (!response.ok || !body.token) {
      error.textContent = body.message || `login refused (${response.status})`;
      error.hidden = false;
      return;
    }
    sessionStorage.setItem(SESSION_KEY, body.token);
    document.getElementById("login-password").value = "";
    document.getElementById("login").hidden = true;
    document.getElementById("main").hidden = false;
    showUser(body.user, body.admin);
    await refresh();
  } catch (failure) {
    error.textContent = `cannot log in: ${failure}`;
    error.hidden = false;
  }
}

function showUser(user, admin) {
  const who = document.getElementById("who");
  who.textContent = user ? `${user}${admin ? " (admin)" : ""}` : "";
  who.hidden = !user;
  document.getElementById("logout").hidden = !sessionStorage.getItem(SESSION_KEY);
}

async function logOut() {
  await fetch("/api/v1/logout", { method: "POST", cache: "no-store", headers: authHeaders() }).catch(() => {});
  needLogin();
}

document.getElementById("login").addEventListener("submit", logIn);
document.getElementById("logout").addEventListener("click", logOut);

// --- poll loop -------------------------------------------------------------------------------

async function refresh() {
  if (!document.getElementById("login").hidden) return;
  const [status, queues, streams, attention, settings] = await Promise.all([
    getJson("/api/v1/status"),
    getJson("/api/v1/queues"),
    getJson("/api/v1/streams"),
    getJson("/api/v1/attention"),
    getJson("/api/v1/settings"),
  ]);
  const updated = document.getElementById("updated");
  if (status.status === 401) return;
  if (status.ok) {
    document.getElementById("node").textContent = `node ${status.body.node ?? "?"}`;
    renderFilesystems(status.body);
    renderMemory(status.body);
    renderCluster(status.body);
    document.title = `${worstLevel(status.body)} · Keratin ${status.body.node ?? ""}`;
    updated.dataset.state = "ok";
    updated.textContent = `updated ${clock(Date.now())}`;
  } else {
    updated.dataset.state = "error";
    updated.textContent = `cannot read /api/v1/status (${status.status || status.error || "no answer"}); showing figures from the last success`;
  }
  renderQueues(queues);
  renderStreams(streams);
  renderAttention(attention);
  renderSettings(settings);
}

// One refresh at a time: the next starts 2 s after the last one finished, so a slow broker is
// never piled up with requests.
async function loop() {
  try {
    await refresh();
  } catch (error) {
    const updated = document.getElementById("updated");
    updated.dataset.state = "error";
    updated.textContent = `dashboard error: ${error}`;
  }
  setTimeout(loop, POLL_MS);
}

getJson("/api/v1/whoami").then((me) => {
  if (me.ok) showUser(me.body.user, me.body.admin);
});
loop();
