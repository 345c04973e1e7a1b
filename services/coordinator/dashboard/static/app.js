// The Tandem dashboard: polls the coordinator every POLL_MS and redraws; controls post to the control API.
"use strict";

const POLL_MS = 2000;
const App = {info: null, xAxis: "step", transcriptsEvery: 3, ticks: 0, last: null};

function token() { return document.getElementById("token").value.trim(); }
// Every call carries the typed token: with api.token configured the API guards reads too.
function auth() { return token() ? {Authorization: "Bearer " + token()} : {}; }

async function getJSON(url) {
  const r = await fetch(url, {cache: "no-store", headers: auth()});
  if (r.status === 401) throw new Error("the API needs its token: type it in the token field");
  if (!r.ok) throw new Error(`${url}: ${r.status}`);
  return r.json();
}

async function control(cmd) {
  if (cmd === "stop" && !window.confirm("Stop the run? (the report is written, then every service stops)")) return;
  const headers = auth();
  const msg = document.getElementById("control-msg");
  msg.className = "";
  try {
    const r = await fetch("/v1/" + cmd, {method: "POST", headers});
    const body = await r.json().catch(() => ({}));
    msg.textContent = r.ok ? `${cmd}: ok` : `${cmd} refused (${r.status}): ${body.detail || r.statusText}`;
    msg.className = r.ok ? "ok" : "error";
    msg.dataset.status = String(r.status);
  } catch (err) {
    msg.textContent = `${cmd} failed: ${err}`;
    msg.className = "error";
  }
  poll();
}

function pill(text, cls) {
  const s = document.createElement("span");
  s.className = "pill " + (cls || "");
  s.textContent = text;
  return s;
}

function drawState(st) {
  const box = document.getElementById("run-state");
  const phaseCls = st.error ? "bad" : st.phase === "done" ? "good" : st.paused ? "warn" : "";
  box.replaceChildren(pill(st.paused ? "paused" : st.phase, phaseCls), pill(`up ${Math.round(st.uptime_s)} s`),
    pill(`${st.episodes} episodes`), pill(`${st.episodes_per_s.toFixed(2)} episodes/s`));
  box.dataset.paused = String(st.paused);
  box.dataset.phase = st.phase;
  if (App.info.read_only) box.prepend(pill("finished run · read-only", "warn"));
  if (st.error) box.append(pill(st.error, "bad"));
}

function kv(label, value, cls) {
  const d = document.createElement("div");
  d.className = "kv " + (cls || "");
  d.innerHTML = "<span></span><b></b>";
  d.firstChild.textContent = label;
  d.lastChild.textContent = value;
  return d;
}

// the last train step's learning signal: zero-variance groups, malformed samples, steps in a row without signal
function signalRow(sig) {
  const f = v => (typeof v === "number" ? v.toFixed(2) : "-");
  if (!sig) return kv("learning signal", "-");
  const none = sig.no_signal_steps || 0;
  return kv("learning signal", `zero-variance groups ${f(sig.zero_variance_groups)} · malformed ${f(sig.malformed_rate)}` +
    (none ? ` · NO SIGNAL for ${none} step(s)` : ""), none ? "warn" : "");
}

// a game: the win/draw/loss score at the start and end; otherwise the environment's own measures, latest eval
function evalRow(st, name, a) {
  const ev = [...(st.evals || [])].reverse().find(e => (e.details || {})[name]);
  const r = ev ? ev.details[name] : null;
  if (r && r.game === false) {
    const means = Object.entries(r.summary_means || {}).map(([k, v]) => `${k} ${v.toFixed(3)}`).join(" · ");
    return kv(`eval (${ev.label})`, means || "-");
  }
  return kv("eval start → end", `${a.eval_start === null ? "-" : a.eval_start.toFixed(3)} → ${a.eval_end === null ? "-" : a.eval_end.toFixed(3)}`);
}

function drawAgents(st, pipe) {
  const box = document.getElementById("agents");
  const cards = Object.entries(st.agents).map(([name, a]) => {
    const g = pipe.gates[name] || {groups: {}};
    const ro = a.rollout || {};
    const card = document.createElement("div");
    card.className = "card";
    card.dataset.agent = name;
    const h = document.createElement("h3");
    h.textContent = "agent " + name;
    h.style.borderColor = TandemCharts.color(name);
    card.append(h, kv("step", `${a.step} / ${st.total_steps}`), kv("weight version", a.weight_version),
      kv("staleness gate", `${g.blocked ? "blocked" : "open"} · ${g.claimed} / ${g.limit} groups (max staleness ${g.max_staleness})`,
        g.blocked ? "warn" : ""),
      kv("groups", `kept ${g.groups.kept} · dropped ${g.groups.dropped} · abandoned ${g.groups.abandoned} · in flight ${g.groups.in_flight}`),
      kv("abandoned for", Object.entries(g.abandon_reasons || {}).map(([r, n]) => `${r}: ${n}`).join(" · ") || "-"),
      kv("queue depth", ro.queue_depth ?? "-"), kv("in-flight turns", `${ro.inflight ?? "-"} / ${ro.capacity ?? "-"}` +
        (ro.waiting ? ` (${ro.waiting} waiting)` : "")),
      kv("recent reward", a.recent_group_reward === null ? "-" : a.recent_group_reward.toFixed(3)),
      signalRow(a.signal), evalRow(st, name, a));
    const engines = document.createElement("table");
    engines.className = "grid engines";
    engines.innerHTML = "<thead><tr><th>engine</th><th>health</th><th>weights</th><th>restarts</th></tr></thead>";
    const tb = document.createElement("tbody");
    for (const e of ro.engines || []) {
      const tr = document.createElement("tr");
      for (const [v, cls] of [[e.url, "mono"], [e.healthy ? "healthy" : "down", e.healthy ? "good" : "bad"],
        [e.weight_version ?? a.weight_version, ""], [e.restarts ?? "-", ""]]) {
        const td = document.createElement("td");
        td.textContent = v;
        td.className = cls;
        tr.append(td);
      }
      tb.append(tr);
    }
    engines.append(tb);
    card.append(engines);
    return card;
  });
  box.replaceChildren(...cards);
}

function drawServices(rows) {
  const body = document.querySelector("#services tbody");
  body.replaceChildren(...rows.map(s => {
    const tr = document.createElement("tr");
    const restarts = [s.restarts, s.engine_restarts ? `engines ${s.engine_restarts}` : null].filter(x => x !== null && x !== undefined);
    for (const [v, cls] of [[s.service, "mono"], [s.healthy ? "alive" : "silent", s.healthy ? "good" : "bad"],
      [s.idle_s === null ? "-" : `${s.idle_s} s ago`, ""],
      [s.last_event ? `${s.last_event} ${s.last_event_s} s ago` : "-", ""], [restarts.join(", ") || "0", ""],
      [s.reads.map(g => g.stream + (g.pending ? ` (${g.pending} pending)` : "")).join(", "), "small"]]) {
      const td = document.createElement("td");
      td.textContent = v;
      td.className = cls;
      tr.append(td);
    }
    return tr;
  }));
}

async function poll() {
  try {
    const [st, metrics, pipe] = await Promise.all([getJSON("/v1/status"), getJSON("/v1/metrics"),
      getJSON("/v1/dashboard/pipeline")]);
    drawState(st);
    App.last = [metrics, st];
    TandemCharts.update(metrics, st, App.info.started_at, App.xAxis);
    drawAgents(st, pipe);
    drawServices(pipe.services);
    if (App.ticks++ % App.transcriptsEvery === 0) await TandemTranscripts.refresh(true);
    document.body.dataset.polls = String(App.ticks);
  } catch (err) {
    const box = document.getElementById("run-state");
    box.replaceChildren(pill("coordinator unreachable: " + err.message, "bad"));
  }
}

async function start() {
  App.info = await getJSON("/v1/dashboard/info");
  document.getElementById("run-name").textContent = `${App.info.run} · ${App.info.environment}`;
  document.title = `Tandem · ${App.info.run}`;
  TandemCharts.agents = Object.keys(App.info.agents).filter(a => App.info.agents[a].train);
  TandemCharts.legend();
  const tok = document.getElementById("token");
  tok.value = localStorage.getItem("tandem-token") || "";
  tok.addEventListener("input", () => localStorage.setItem("tandem-token", tok.value));
  if (!App.info.token_required) tok.placeholder = "no token configured";
  document.querySelectorAll("button[data-cmd]").forEach(b => b.addEventListener("click", () => control(b.dataset.cmd)));
  document.getElementById("x-axis").addEventListener("change", ev => { App.xAxis = ev.target.value; poll(); });
  const smoothing = document.getElementById("smoothing");
  TandemCharts.smoothing = Number(smoothing.value);
  smoothing.addEventListener("change", () => {
    TandemCharts.smoothing = Number(smoothing.value);
    if (App.last) TandemCharts.update(App.last[0], App.last[1], App.info.started_at, App.xAxis);
  });
  if (App.info.read_only) {  // a finished run (tandem dashboard RUN): nothing to control, nothing new to poll
    document.getElementById("controls").hidden = true;
    App.transcriptsEvery = 1e9;
  }
  TandemTranscripts.setOptions(App.info);
  await poll();
  if (!App.info.read_only) setInterval(poll, POLL_MS);
}

start();
