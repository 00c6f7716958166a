// swarmloco dashboard: polls the coordinator's JSON API and draws charts with the vendored Chart.js.
// Untrusted strings (peer ids, device names, failure reasons) are only ever inserted with textContent.
"use strict";

const REFRESH_MS = 2000;
const PAGE = 1000;
const MAX_PAGES_PER_REFRESH = 20;
// The round outcomes peers report (protocol/base/outcome.py); anything else is drawn grey.
const OUTCOME_COLORS = { committed: "#2e9d5b", discarded: "#d08a1c", mismatch: "#c83a3a", behind: "#888888" };
const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                 "#bcbd22", "#17becf"];

const state = { runId: null, metricsCursor: null, metrics: [], rounds: [], peers: [], accounting: null,
                colors: new Map(), refreshes: 0, lastError: null };
window.swarmloco = state;  // for debugging and the browser test

function peerColor(peerId) {
  if (!state.colors.has(peerId)) state.colors.set(peerId, PALETTE[state.colors.size % PALETTE.length]);
  return state.colors.get(peerId);
}
const short = (peerId) => "…" + peerId.slice(-8);
const fmt = (x, digits = 0) => (x === null || x === undefined) ? "–" :
  Number(x).toLocaleString(undefined, { maximumFractionDigits: digits, minimumFractionDigits: digits });

async function getJSON(path, params = {}) {
  const url = new URL(path, window.location.origin);
  for (const [k, v] of Object.entries(params)) if (v !== null && v !== undefined) url.searchParams.set(k, v);
  const resp = await fetch(url, { cache: "no-store" });
  if (!resp.ok) throw new Error(`${path}: HTTP ${resp.status}`);
  return resp.json();
}

async function getAll(path, params, cursor = null) {
  let items = [];
  for (let i = 0; i < MAX_PAGES_PER_REFRESH; i++) {
    const page = await getJSON(path, { ...params, limit: PAGE, cursor });
    items = items.concat(page.items);
    if (page.next_cursor === null) return { items, cursor: page.items.length ? page.items.at(-1).id : cursor };
    cursor = page.next_cursor;
  }
  return { items, cursor };
}

function lineChart(canvasId, xTitle, yTitle, xType = "linear") {
  return new Chart(document.getElementById(canvasId), {
    type: "line",
    data: { datasets: [] },
    options: {
      animation: false, responsive: true, maintainAspectRatio: false, parsing: false, normalized: true,
      interaction: { mode: "nearest", intersect: false },
      elements: { point: { radius: 2 }, line: { borderWidth: 1.5 } },
      scales: { x: { type: xType, title: { display: true, text: xTitle } },
                y: { title: { display: true, text: yTitle } } },
      plugins: { legend: { position: "bottom", labels: { boxWidth: 12 } } },
    },
  });
}

const charts = {};

function initCharts() {
  charts.train = lineChart("chart-train", "tokens (this peer)", "train loss");
  charts.eval = lineChart("chart-eval", "swarm tokens (committed rounds)", "eval loss");
  charts.throughput = lineChart("chart-throughput", "seconds since first report", "tokens/s");
  charts.rounds = stackedBarChart("chart-rounds", "round", "seconds",
                                  { callbacks: { afterBody: (items) => roundTooltip(items) } });
  charts.cost = lineChart("chart-cost", "billed device-hours", "eval loss");
  charts.contrib = stackedBarChart("chart-contrib", "peer", "tokens");
  window.swarmlocoCharts = charts;
}

function stackedBarChart(canvasId, xTitle, yTitle, tooltip = {}) {
  return new Chart(document.getElementById(canvasId), {
    type: "bar",
    data: { labels: [], datasets: [] },
    options: {
      animation: false, responsive: true, maintainAspectRatio: false,
      scales: { x: { stacked: true, title: { display: true, text: xTitle } },
                y: { stacked: true, title: { display: true, text: yTitle } } },
      plugins: { legend: { position: "bottom", labels: { boxWidth: 12 } }, tooltip },
    },
  });
}

function updateAccounting() {
  // What the run bought: eval loss over the device-hours of credited peers, and each contributor's verified and
  // wasted work (refused by certified rounds, dropped on resync, lost with a process that ended).
  const acc = state.accounting;
  const points = (acc ? acc.progress : []).filter((p) => p.eval_loss !== null);
  charts.cost.data.datasets = [{ label: "eval loss (certified rounds)", borderColor: "#000", backgroundColor: "#000",
                                 data: points.map((p) => ({ x: p.device_hours, y: p.eval_loss })) }];
  charts.cost.update();
  const peers = [...state.peers].sort((a, b) => b.credited_tokens - a.credited_tokens);
  charts.contrib.data.labels = peers.map((p) => short(p.peer_id));
  charts.contrib.data.datasets = [
    { label: "verified", data: peers.map((p) => p.credited_tokens), backgroundColor: "#2e9d5b" },
    { label: "wasted", data: peers.map((p) => p.wasted_tokens), backgroundColor: "#c83a3a" },
  ];
  charts.contrib.update();
  const body = document.querySelector("#contributors-table tbody");
  body.replaceChildren();
  for (const p of peers) {
    const tr = document.createElement("tr");
    peerCell(tr, p.peer_id);
    cell(tr, p.device_kind);
    cell(tr, fmt(p.device_s / 3600, 3), "num");
    cell(tr, fmt(p.compute_s / 3600, 3), "num");
    cell(tr, fmt(p.credited_tokens), "num");
    cell(tr, fmt(p.wasted_tokens), "num").title = `refused ${fmt(p.refused_tokens)}, ` +
      `dropped ${fmt(p.dropped_tokens)}, lost with a process ${fmt(p.exit_tokens)}, pending ${fmt(p.pending_tokens)}`;
    cell(tr, fmt(p.bytes_sent / 2 ** 20, 1), "num");
    cell(tr, fmt(p.bytes_received / 2 ** 20, 1), "num");
    cell(tr, `${p.rounds_joined} / ${p.rounds_led} / ${p.rounds_missed}`, "num");
    cell(tr, fmt(p.resyncs), "num");
    cell(tr, fmt(p.lost_s, 0), "num");
    body.appendChild(tr);
  }
  if (!acc) return;
  document.getElementById("card-goodput").textContent =
    acc.goodput_tokens_per_s === null ? "–" : fmt(acc.goodput_tokens_per_s) + " tok/s";
  const perPoint = acc.cost_per_eval_loss_point === null ? "" : ` (${fmt(acc.cost_per_eval_loss_point, 2)})`;
  document.getElementById("card-cost").textContent = acc.cost === null ? "–" : fmt(acc.cost, 2) + perPoint;
  const hours = Object.values(acc.device_hours).reduce((s, h) => s + h, 0);
  document.getElementById("contributors-note").textContent = `${fmt(acc.verified_tokens)} verified, ` +
    `${fmt(acc.wasted_tokens)} wasted; ${fmt(hours, 2)} billed device-hours` +
    (acc.cost === null ? (Object.keys(acc.prices).length ? `; no price for ${acc.unpriced.join(", ")}` :
                          "; start the coordinator with --price for the cost") : "");
}

function roundTooltip(items) {
  const r = state.roundsShown?.[items[0]?.dataIndex];
  if (!r) return "";
  const lines = [`outcome: ${r.outcome}`, `members: ${r.members.length}`];
  if (r.failure_reasons.length) lines.push(`failure: ${r.failure_reasons.join("; ")}`);
  return lines;
}

function byPeer(points, key) {
  const groups = new Map();
  for (const m of points) {
    if (m[key] === null || m[key] === undefined) continue;
    if (!groups.has(m.peer_id)) groups.set(m.peer_id, []);
    groups.get(m.peer_id).push(m);
  }
  return groups;
}

function peerDatasets(groups, xOf, yKey) {
  return [...groups.entries()].map(([peerId, pts]) => ({
    label: short(peerId), borderColor: peerColor(peerId), backgroundColor: peerColor(peerId),
    data: pts.map((m) => ({ x: xOf(m), y: m[yKey] })).sort((a, b) => a.x - b.x),
  }));
}

function updateCharts() {
  charts.train.data.datasets = peerDatasets(byPeer(state.metrics, "train_loss"), (m) => m.tokens_total, "train_loss");
  charts.train.update();

  let swarmTokens = 0;
  const evalPoints = [];
  const ordered = [...state.rounds].sort((a, b) => a.round - b.round || a.id - b.id);
  for (const r of ordered) {
    if (r.outcome !== "committed") continue;
    swarmTokens += r.tokens_total;
    if (r.eval_loss !== null) evalPoints.push({ x: swarmTokens, y: r.eval_loss });
  }
  const evalSets = [{ label: "swarm eval loss (rounds)", data: evalPoints, borderColor: "#000",
                      backgroundColor: "#000" }];
  const peerEval = peerDatasets(byPeer(state.metrics, "eval_loss"), (m) => m.tokens_total, "eval_loss");
  if (!evalPoints.length) for (const d of peerEval) evalSets.push({ ...d, label: d.label + " eval (own tokens)" });
  charts.eval.data.datasets = evalSets;
  charts.eval.update();

  const t0 = state.metrics.length ? Math.min(...state.metrics.map((m) => m.timestamp)) : 0;
  // eval-only samples (no train loss) and a peer's first step carry tokens_per_s 0, not a measurement
  const rates = state.metrics.filter((m) => m.train_loss !== null && m.tokens_per_s > 0);
  charts.throughput.data.datasets = peerDatasets(byPeer(rates, "tokens_per_s"), (m) => m.timestamp - t0, "tokens_per_s");
  charts.throughput.update();

  const shown = ordered.slice(-60);
  state.roundsShown = shown;
  charts.rounds.data.labels = shown.map((r) => String(r.round));
  const outcomeColors = shown.map((r) => OUTCOME_COLORS[r.outcome] || "#555");
  charts.rounds.data.datasets = [
    { label: "train", data: shown.map((r) => r.train_s), backgroundColor: outcomeColors },
    { label: "wait", data: shown.map((r) => r.wait_s), backgroundColor: "#9ecae1" },
    { label: "average", data: shown.map((r) => r.average_s), backgroundColor: "#3182bd" },
  ];
  charts.rounds.update();
}

function cell(row, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  row.appendChild(td);
  return td;
}

function peerCell(row, peerId) {
  // the short id, the whole one on hover, in the peer's colour (as in the charts)
  const td = cell(row, short(peerId));
  td.title = peerId;
  td.style.color = peerColor(peerId);
}

function updateTables() {
  const peersBody = document.querySelector("#peers-table tbody");
  peersBody.replaceChildren();
  for (const p of state.peers) {
    const tr = document.createElement("tr");
    peerCell(tr, p.peer_id);
    cell(tr, p.online ? "online" : (p.left_at ? "left" : "offline"), p.online ? "online" : "offline");
    cell(tr, p.device ?? "–");
    cell(tr, p.memory_bytes ? fmt(p.memory_bytes / 2 ** 30, 1) + " GiB" : "–", "num");
    cell(tr, fmt(p.tokens_per_s), "num");
    cell(tr, fmt(p.credited_tokens), "num").title = `reported by the peer: ${fmt(p.tokens_total)}`;
    // what the authority's newest checkpoint vouches for (it lags by up to one checkpoint period); a chain no
    // checkpoint vouches for (identities nobody credited, signing among themselves) stays at 0 here
    cell(tr, p.vouched_tokens === undefined ? "–" : fmt(p.vouched_tokens), "num").title =
      p.seniority ? `seniority ${fmt(p.seniority)}` : "on probation, or not on the checkpointed chain";
    cell(tr, fmt(p.rounds_committed), "num");
    cell(tr, fmt(p.last_train_loss, 4), "num");
    cell(tr, fmt(p.last_tokens_per_s), "num");
    cell(tr, new Date(p.last_seen * 1000).toLocaleTimeString());
    peersBody.appendChild(tr);
  }
  const roundsBody = document.querySelector("#rounds-table tbody");
  roundsBody.replaceChildren();
  for (const r of [...state.rounds].sort((a, b) => b.round - a.round || b.id - a.id).slice(0, 30)) {
    const tr = document.createElement("tr");
    cell(tr, String(r.round), "num");
    const badge = document.createElement("span");
    badge.className = "badge outcome-" + r.outcome;
    badge.textContent = r.outcome;
    cell(tr, "").appendChild(badge);
    cell(tr, r.members.map(short).join(" "));
    cell(tr, fmt(r.tokens_total), "num");
    cell(tr, `${fmt(r.train_s, 1)} / ${fmt(r.wait_s, 1)} / ${fmt(r.average_s, 1)}`, "num");
    cell(tr, fmt(r.eval_loss, 4), "num");
    cell(tr, r.state_hash ? r.state_hash.slice(0, 12) : "–");
    cell(tr, r.failure_reasons.join("; ") || "");
    roundsBody.appendChild(tr);
  }
}

function updateCards() {
  const online = state.peers.filter((p) => p.online);
  document.getElementById("card-peers").textContent = `${online.length} / ${state.peers.length}`;
  const committed = state.rounds.filter((r) => r.outcome === "committed").length;
  document.getElementById("card-rounds").textContent = `${committed} / ${state.rounds.length - committed}`;
  document.getElementById("card-tokens").textContent = fmt(state.peers.reduce((s, p) => s + p.credited_tokens, 0));
  const tps = online.reduce((s, p) => s + (p.last_tokens_per_s || 0), 0);
  document.getElementById("card-throughput").textContent = fmt(tps) + " tok/s";
  const lastEval = [...state.rounds].filter((r) => r.eval_loss !== null).sort((a, b) => b.round - a.round)[0];
  document.getElementById("card-eval").textContent = lastEval ? fmt(lastEval.eval_loss, 4) : "–";
}

async function loadRuns() {
  const runs = await getJSON("/api/runs", { limit: PAGE });
  const select = document.getElementById("run-select");
  const wanted = new URLSearchParams(window.location.search).get("run") || state.runId || runs.default_run_id;
  select.replaceChildren(...runs.items.map((r) => {
    const opt = document.createElement("option");
    opt.value = opt.textContent = r.run_id;
    return opt;
  }));
  select.value = wanted;
  if (state.runId !== wanted) selectRun(wanted);
}

function selectRun(runId) {
  Object.assign(state, { runId, metricsCursor: null, metrics: [], rounds: [], peers: [], accounting: null });
}

async function refresh() {
  try {
    if (state.refreshes % 10 === 0 || state.runId === null) await loadRuns();
    const run = state.runId;
    const [peers, rounds, metrics, accounting] = await Promise.all([
      getAll("/api/peers", { run_id: run }),
      getAll("/api/rounds", { run_id: run }),
      getAll("/api/metrics", { run_id: run }, state.metricsCursor),
      getJSON("/api/accounting", { run_id: run }),
    ]);
    if (run !== state.runId) return;  // the user switched runs meanwhile
    state.peers = peers.items;
    state.accounting = accounting;
    state.rounds = rounds.items;
    state.metrics = state.metrics.concat(metrics.items);
    state.metricsCursor = metrics.cursor;
    updateCharts();
    updateTables();
    updateCards();
    updateAccounting();
    state.refreshes += 1;
    state.lastError = null;
    document.getElementById("status").textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (err) {
    state.lastError = String(err);
    document.getElementById("status").textContent = `coordinator unreachable (${err.message}); retrying…`;
  } finally {
    setTimeout(refresh, REFRESH_MS);
  }
}

async function showJoin() {
  // The command a volunteer runs: the manifest names everything else. An invite code is a secret: never shown here.
  const manifest = await getJSON("/api/manifest", {});
  const invite = manifest.admission === "invite" ? " --invite CODE" : "";
  document.getElementById("join-command").textContent = `swarmloco peer --join ${window.location.origin}${invite}`;
  document.getElementById("join-note").textContent = invite ? "ask the run's operator for the invite code" :
    manifest.admission === "open" ? "open run: a new identity solves a short proof of work first" : "";
}

function copyJoin() {
  const text = document.getElementById("join-command").textContent;
  const done = () => { document.getElementById("join-copy").textContent = "copied"; };
  if (navigator.clipboard && window.isSecureContext) {
    navigator.clipboard.writeText(text).then(done, () => {});
    return;
  }
  const range = document.createRange();  // plain http on another host: select it and use the old copy command
  range.selectNodeContents(document.getElementById("join-command"));
  window.getSelection().removeAllRanges();
  window.getSelection().addRange(range);
  if (document.execCommand("copy")) done();
}

document.addEventListener("DOMContentLoaded", () => {
  initCharts();
  showJoin().catch((err) => { document.getElementById("join-note").textContent = `no manifest (${err.message})`; });
  document.getElementById("join-copy").addEventListener("click", copyJoin);
  document.getElementById("run-select").addEventListener("change", (e) => {
    selectRun(e.target.value);
    const url = new URL(window.location.href);
    url.searchParams.set("run", e.target.value);
    window.history.replaceState(null, "", url);
  });
  refresh();
});
