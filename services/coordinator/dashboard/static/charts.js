// Charts of the Tandem dashboard: one uPlot chart per metric, one series per agent.
// Each chart's element carries data-points = {"agent": number of points}, which the browser test reads.
"use strict";

const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4b5563", "#ca8a04"];
// train_step keys shown first; any other numeric key follows
const PREFERRED = ["reward_mean", "pg_loss", "loss", "kl", "entropy", "clip_frac", "grad_norm", "tis_weight_mean",
  "tis_clipped_frac", "tokens_per_s", "lr"];
// Each group's place on the training-step axis: the groups emitted while step k was the latest trained one
// (0 before the first) are spread evenly over [k, k + 1) in their order (as `tandem compare` plots them).
function groupSteps(groups, steps) {
  const done = steps.filter(s => typeof s.time === "number" && typeof s.weight_version === "number")
    .map(s => [s.time, s.weight_version]).sort((x, y) => x[0] - y[0]);
  const ks = groups.map(g => { let k = 0; for (const [t, v] of done) { if (t <= g[0]) k = v; else break; } return k; });
  const counts = {}, seen = {};
  ks.forEach(k => { counts[k] = (counts[k] || 0) + 1; });
  return ks.map(k => { const x = k + (seen[k] || 0) / counts[k]; seen[k] = (seen[k] || 0) + 1; return +x.toFixed(4); });
}

const SKIP = new Set(["weight_version", "time", "samples", "samples_trained", "optimizer_steps", "tokens", "train_seconds"]);

// uPlot's own range fails ("Invalid array length") on a nearly flat series (e.g. 1.0 and 1.0000005): pad it
function yRange(u, min, max) {
  if (min == null || max == null) return [0, 1];
  const mag = Math.max(Math.abs(min), Math.abs(max), 1e-9);
  if (max - min < mag * 1e-3) return [min - mag * 0.05, max + mag * 0.05];
  return uPlot.rangeNum(min, max, 0.1, true);
}

const Charts = {
  agents: [],
  charts: {},        // key -> {plot, el, title}
  color(agent) { return COLORS[this.agents.indexOf(agent) % COLORS.length]; },

  ensure(key, title, xLabel) {
    if (this.charts[key]) return this.charts[key];
    const box = document.createElement("div");
    box.className = "chart";
    box.id = "chart-" + key.replace(/[^A-Za-z0-9_-]/g, "_");
    box.dataset.key = key;
    box.dataset.points = "{}";
    const h = document.createElement("h4");
    h.textContent = title;
    box.appendChild(h);
    document.getElementById("charts").appendChild(box);
    const series = [{label: xLabel}].concat(this.agents.map(a => ({
      label: a, stroke: this.color(a), width: 1.5, spanGaps: true, points: {show: true, size: 4},
    })));
    const opts = {width: 380, height: 200, series, legend: {show: false},
      scales: {x: {time: false}, y: {range: yRange}}, axes: [{label: xLabel, size: 40}, {size: 50}]};
    const empty = [[]].concat(this.agents.map(() => []));
    const plot = new uPlot(opts, empty, box);
    this.charts[key] = {plot, el: box, title};
    return this.charts[key];
  },

  // perAgent: {agent: [[x...], [y...]]}
  set(key, title, xLabel, perAgent) {
    const c = this.ensure(key, title, xLabel);
    const tables = this.agents.map(a => perAgent[a] || [[], []]);
    const data = uPlot.join(tables).map((s, i) => (i ? s.map(v => (v === undefined ? null : v)) : s));
    try {
      c.plot.setData(data);
      c.el.classList.remove("failed");
    } catch (err) {  // one chart that cannot draw must not stop the others
      c.el.classList.add("failed");
      c.el.title = "could not draw: " + err;
    }
    const points = {};
    this.agents.forEach(a => { points[a] = (perAgent[a] || [[]])[0].length; });
    c.el.dataset.points = JSON.stringify(points);
  },

  legend() {
    const el = document.getElementById("legend");
    el.innerHTML = "";
    this.agents.forEach(a => {
      const s = document.createElement("span");
      s.innerHTML = `<i style="background:${this.color(a)}"></i>`;
      s.appendChild(document.createTextNode(a));
      el.appendChild(s);
    });
  },

  // metrics: /v1/metrics; status: /v1/status; t0: run start (unix s); xAxis: "step" | "time"
  update(metrics, status, t0, xAxis) {
    const rewards = {}, evals = {};
    for (const a of this.agents) {
      const gr = (metrics[a] || {}).group_rewards || [];
      rewards[a] = [groupSteps(gr, (metrics[a] || {}).train_steps || []), gr.map(p => p[1])];
      evals[a] = [[], []];
    }
    this.set("reward", "training reward per group", "training step", rewards);
    for (const e of status.evals || []) {
      for (const [a, score] of Object.entries(e.scores || {})) {
        if (!evals[a] || score === null) continue;
        evals[a][0].push((e.versions || {})[a] || 0);
        evals[a][1].push(score);
      }
    }
    this.set("eval", "held-out eval score (vs scripted)", "weight version", evals);
    // every further opponent (eval.opponents) gets its own chart; the first is the one above
    const opponents = [];
    for (const e of status.evals || []) for (const o of e.opponents || []) if (!opponents.includes(o)) opponents.push(o);
    for (const o of opponents.slice(1)) {
      const per = {};
      for (const a of this.agents) per[a] = [[], []];
      for (const e of status.evals || []) {
        for (const [a, vs] of Object.entries(e.vs || {})) {
          const r = vs[o];
          if (!per[a] || !r || r.score === null) continue;
          per[a][0].push((e.versions || {})[a] || 0);
          per[a][1].push(r.score);
        }
      }
      this.set("eval-" + o, "held-out eval score vs " + o, "weight version", per);
    }
    const illegal = {};
    for (const a of this.agents) {
      const tp = ((metrics[a] || {}).train_play || []).filter(p => p.illegal_rate !== null);
      illegal[a] = [tp.map(p => p.weight_version), tp.map(p => p.illegal_rate)];
    }
    this.set("illegal", "training episodes with an illegal / malformed reply", "weight version", illegal);
    const keys = new Set();
    for (const a of this.agents) {
      for (const s of (metrics[a] || {}).train_steps || []) {
        for (const [k, v] of Object.entries(s)) if (typeof v === "number" && !SKIP.has(k)) keys.add(k);
      }
    }
    const ordered = PREFERRED.filter(k => keys.has(k)).concat([...keys].filter(k => !PREFERRED.includes(k)).sort());
    for (const k of ordered) {
      const per = {};
      for (const a of this.agents) {
        const steps = ((metrics[a] || {}).train_steps || []).filter(s => typeof s[k] === "number");
        const xs = steps.map((s, i) => xAxis === "time" ? +((s.time || 0) - t0).toFixed(1) : (s.weight_version || i + 1));
        per[a] = [xs, steps.map(s => s[k])];
      }
      this.set("train-" + k + "-" + xAxis, k, xAxis === "time" ? "seconds" : "step", per);
    }
    // charts of the other x axis are hidden, not dropped (switching back keeps them)
    for (const c of Object.values(this.charts)) {
      const key = c.el.dataset.key;
      c.el.hidden = key.startsWith("train-") && !key.endsWith("-" + xAxis);
    }
  },
};
window.TandemCharts = Charts;
