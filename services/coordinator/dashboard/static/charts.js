// Charts of the Tandem dashboard: one uPlot chart per metric, one series per agent.
// Each chart's element carries data-points = {"agent": number of points} and data-metric (what it plots),
// which the browser test reads. Step axes span the run's steps (0 to the newest step), tick labels are
// formatted so no two read the same and each axis is as wide as its longest label.
"use strict";

const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4b5563", "#ca8a04"];
// train_step keys shown first; any other numeric key follows
const PREFERRED = ["reward_mean", "pg_loss", "loss", "kl", "entropy", "clip_frac", "grad_norm", "tis_weight_mean",
  "tis_clipped_frac", "tokens_per_s", "lr"];
const SKIP = new Set(["weight_version", "time", "samples", "samples_trained", "optimizer_steps", "tokens", "train_seconds"]);
const AXIS_FONT = '11px system-ui, "DejaVu Sans", sans-serif';
const TICK = 8, GAP = 4;
const INT_INCRS = [1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000];

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

// exponential moving average (TensorBoard's smoothing, debiased at the start); weight 0: the values as they are
function smooth(ys, weight) {
  if (!weight) return ys.slice();
  let last = 0, n = 0;
  return ys.map(y => { n += 1; last = last * weight + (1 - weight) * y; return last / (1 - Math.pow(weight, n)); });
}

// tick labels that differ from each other: the fewest decimals (or significant digits) that tell them apart
function tickLabels(splits) {
  const vals = splits.filter(v => v != null);
  const big = Math.max(...vals.map(Math.abs), 0);
  const small = big > 0 && big < 1e-3;
  const fmts = [];
  if (big >= 1e4 && !small) {
    for (let d = 0; d <= 3; d++) fmts.push(v => (v === 0 ? "0" : (Math.abs(v) >= 1e6 ? (v / 1e6).toFixed(d) + "M" : (v / 1e3).toFixed(d) + "k")));
  }
  if (!small) for (let d = 0; d <= 8; d++) fmts.push(v => v.toFixed(d));
  for (let p = 0; p <= 8; p++) fmts.push(v => (v === 0 ? "0" : v.toExponential(p)));
  for (const f of fmts) {
    const out = splits.map(v => (v == null ? "" : f(v)));
    if (new Set(out.filter(s => s !== "")).size === vals.length) return out;
  }
  return splits.map(v => (v == null ? "" : String(v)));
}

let measurer = null;
function textWidth(text) {
  measurer = measurer || document.createElement("canvas").getContext("2d");
  measurer.font = AXIS_FONT;
  return measurer.measureText(text).width;
}

// a left axis as wide as its widest tick label (uPlot passes the formatted labels)
function yAxisSize(u, values) {
  const widest = Math.max(0, ...(values || []).map(v => textWidth(String(v))));
  return Math.ceil(widest) + TICK + GAP + 4;
}

// uPlot's own range fails ("Invalid array length") on a nearly flat series (e.g. 1.0 and 1.0000005): pad it
function yRange(u, min, max) {
  if (min == null || max == null) return [0, 1];
  const mag = Math.max(Math.abs(min), Math.abs(max));
  if (mag < 1e-12) return [0, 1];  // all zero (e.g. a fraction that never moved)
  if (max - min < mag * 1e-3) return [min - mag * 0.05, max + mag * 0.05];
  return uPlot.rangeNum(min, max, 0.1, true);
}

const Charts = {
  agents: [],
  charts: {},        // key -> {plot, el, title}
  xMax: 1,           // the newest training step of the run (the step axes end there)
  smoothing: 0.6,    // the reward chart's EMA weight (the page's smoothing control)
  color(agent) { return COLORS[this.agents.indexOf(agent) % COLORS.length]; },

  // as many charts a row as fit at 330 px or more, filling the row
  width() {
    const room = (document.getElementById("charts").clientWidth || 400) - 2;
    const cols = Math.max(1, Math.floor(room / 340));
    return Math.max(240, Math.floor(room / cols) - 20);
  },

  resize() {
    const width = this.width();
    for (const c of Object.values(this.charts)) if (c.plot.width !== width) c.plot.setSize({width, height: 200});
  },

  // spec: {key, title, unit, metric, xLabel, stepAxis, yFixed, smoothed}
  ensure(spec) {
    if (this.charts[spec.key]) return this.charts[spec.key];
    const box = document.createElement("div");
    box.className = "chart";
    box.id = "chart-" + spec.key.replace(/[^A-Za-z0-9_-]/g, "_");
    box.dataset.key = spec.key;
    box.dataset.metric = spec.metric;
    box.dataset.points = "{}";
    box.appendChild(document.createElement("h4"));
    document.getElementById("charts").appendChild(box);
    const series = [{label: spec.xLabel}];
    for (const a of this.agents) {
      if (spec.smoothed) series.push({label: a + " (each group)", stroke: this.color(a) + "55", width: 0,
        points: {show: true, size: 3, fill: this.color(a) + "55", stroke: this.color(a) + "55"}});
      series.push({label: a, stroke: this.color(a), width: 1.5, spanGaps: true, points: {show: !spec.smoothed, size: 4}});
    }
    const xAxis = {label: spec.xLabel, size: 30, labelSize: 16, font: AXIS_FONT, gap: GAP, ticks: {size: TICK},
      values: (u, splits) => tickLabels(splits)};
    if (spec.stepAxis) xAxis.incrs = INT_INCRS;
    const opts = {width: this.width(), height: 200, series, legend: {show: false}, padding: [8, 14, 0, 0],
      scales: {x: {time: false, auto: !spec.stepAxis}, y: {range: spec.yFixed ? () => spec.yFixed : yRange}},
      axes: [xAxis, {size: yAxisSize, font: AXIS_FONT, gap: GAP, ticks: {size: TICK},
        values: (u, splits) => tickLabels(splits)}]};
    const plot = new uPlot(opts, [[]].concat(series.slice(1).map(() => [])), box);
    this.charts[spec.key] = {plot, el: box};
    return this.charts[spec.key];
  },

  // perAgent: {agent: [[x...], [y...]]} (a smoothed chart draws each point and the smoothed line)
  set(spec, perAgent) {
    const c = this.ensure(spec);
    const h = c.el.querySelector("h4");  // titled at every update: the eval opponent is known once one ran
    h.textContent = spec.unit ? `${spec.title} (${spec.unit})` : spec.title;
    h.title = spec.tooltip || `metric: ${spec.metric}`;
    c.el.dataset.metric = spec.metric;
    const tables = this.agents.map(a => {
      const [xs, ys] = perAgent[a] || [[], []];
      return spec.smoothed ? [xs, ys, smooth(ys, this.smoothing)] : [xs, ys];
    });
    const data = uPlot.join(tables).map((s, i) => (i ? s.map(v => (v === undefined ? null : v)) : s));
    try {
      c.plot.setData(data);
      if (spec.stepAxis) {  // 0 to the run's newest step (uPlot's own range pads a lone point to e.g. 0-100)
        const top = data[0].reduce((m, v) => (v != null && v > m ? v : m), Math.max(this.xMax, 1));
        c.plot.setScale("x", {min: 0, max: Math.ceil(top)});
      }
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

  // the run's newest training step: its agents' steps, their train steps' versions and the evaluated versions
  newestStep(metrics, status) {
    let top = 1;
    for (const a of this.agents) {
      top = Math.max(top, ((status.agents || {})[a] || {}).step || 0);
      for (const s of (metrics[a] || {}).train_steps || []) top = Math.max(top, s.weight_version || 0);
    }
    for (const e of status.evals || []) for (const v of Object.values(e.versions || {})) top = Math.max(top, v || 0);
    return top;
  },

  evalCharts(status) {
    const evals = status.evals || [];
    const opponents = [];
    for (const e of evals) for (const o of e.opponents || []) if (!opponents.includes(o)) opponents.push(o);
    if (!opponents.length) {  // an evaluation from before several opponents names its opponent in its details
      for (const e of evals) for (const d of Object.values(e.details || {})) {
        const o = typeof d.opponent === "string" ? d.opponent : null;
        if (o && !opponents.includes(o)) opponents.push(o);
      }
    }
    const first = opponents[0] || "the eval opponent";
    const spec = (key, o) => ({key, title: `Held-out eval score vs ${o}`, unit: "win 1, draw ½", metric: `eval_${o}/score`,
      xLabel: "training step", stepAxis: true, yFixed: [0, 1]});
    const per = {};
    for (const a of this.agents) per[a] = [[], []];
    for (const e of evals) {
      for (const [a, score] of Object.entries(e.scores || {})) {
        if (!per[a] || score === null) continue;
        per[a][0].push((e.versions || {})[a] || 0);
        per[a][1].push(score);
      }
    }
    this.set(spec("eval", first), per);
    for (const o of opponents.slice(1)) {  // every further opponent (eval.opponents) gets its own chart
      const more = {};
      for (const a of this.agents) more[a] = [[], []];
      for (const e of evals) {
        for (const [a, vs] of Object.entries(e.vs || {})) {
          const r = vs[o];
          if (!more[a] || !r || r.score === null) continue;
          more[a][0].push((e.versions || {})[a] || 0);
          more[a][1].push(r.score);
        }
      }
      this.set(spec("eval-" + o, o), more);
    }
  },

  // metrics: /v1/metrics; status: /v1/status; t0: run start (unix s); xAxis: "step" | "time"
  update(metrics, status, t0, xAxis) {
    this.xMax = this.newestStep(metrics, status);
    const rewards = {};
    for (const a of this.agents) {
      const gr = (metrics[a] || {}).group_rewards || [];
      rewards[a] = [groupSteps(gr, (metrics[a] || {}).train_steps || []), gr.map(p => p[1])];
    }
    this.set({key: "reward", title: "Training reward per group", unit: "mean over the group's episodes",
      metric: "reward/group_mean", xLabel: "training step", stepAxis: true, smoothed: true,
      tooltip: "each dot: one group's mean reward; the line: their moving average (the smoothing control)"}, rewards);
    this.evalCharts(status);
    const illegal = {};
    for (const a of this.agents) {
      const tp = ((metrics[a] || {}).train_play || []).filter(p => p.illegal_rate !== null);
      illegal[a] = [tp.map(p => p.weight_version), tp.map(p => p.illegal_rate)];
    }
    this.set({key: "illegal", title: "Training episodes with an illegal or malformed reply", unit: "fraction",
      metric: "play/illegal_rate", xLabel: "training step", stepAxis: true}, illegal);
    this.trainCharts(metrics, t0, xAxis);
  },

  trainCharts(metrics, t0, xAxis) {
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
      const [title, unit] = TandemLabels.metricLabel(k);
      this.set({key: "train-" + k + "-" + xAxis, title, unit, metric: "train/" + k,
        tooltip: `metric: ${k} (TensorBoard: <agent>/train/${k})`,
        xLabel: xAxis === "time" ? "seconds since the start" : "training step", stepAxis: xAxis !== "time"}, per);
    }
    // charts of the other x axis are hidden, not dropped (switching back keeps them)
    for (const c of Object.values(this.charts)) {
      const key = c.el.dataset.key;
      c.el.hidden = key.startsWith("train-") && !key.endsWith("-" + xAxis);
    }
  },
};
window.TandemCharts = Charts;
// the charts' row width changes with the window and when the page grows a scrollbar
new ResizeObserver(() => Charts.resize()).observe(document.getElementById("charts"));
