// The transcript browser: filtered episode list, one episode's turns, board and (on demand) tokens.
"use strict";

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(c == null ? "" : String(c)));
  return e;
}

function fmt(v, digits = 3) {
  if (v === null || v === undefined) return "-";
  return typeof v === "number" ? (Number.isInteger(v) ? String(v) : v.toFixed(digits)) : String(v);
}

function rewardsText(rewards) {
  return Object.entries(rewards || {}).map(([r, v]) => `${r} ${typeof v === "number" ? v.toFixed(2) : fmt(v)}`)
    .join(", ");
}

function outcome(summary) {
  if (!summary) return "";
  if (summary.truncated) return "truncated";
  if (summary.illegal) return "illegal move";
  if (summary.winner !== undefined && summary.winner !== null) return summary.winner === "draw" ? "draw" : summary.winner + " won";
  return "";
}

const Transcripts = {
  selected: null,

  query() {
    const form = document.getElementById("filters");
    const q = new URLSearchParams({limit: "40"});
    for (const [k, v] of new FormData(form).entries()) if (v !== "") q.set(k, v);
    return q;
  },

  setOptions(info) {
    const form = document.getElementById("filters");
    for (const a of Object.keys(info.agents)) form.agent.append(el("option", {value: a}, a));
    for (const r of info.env_roles) form.role.append(el("option", {value: r}, r));
    form.addEventListener("change", () => { this.refresh(); });
    form.addEventListener("submit", ev => { ev.preventDefault(); this.refresh(); });
  },

  async refresh() {
    const r = await fetch("/v1/dashboard/episodes?" + this.query(), {headers: auth()});
    const body = document.querySelector("#episodes tbody");
    if (!r.ok) {
      document.getElementById("episode-count").textContent = `filter refused: ${(await r.json()).detail}`;
      return;
    }
    const data = await r.json();
    document.getElementById("episode-count").textContent = `${data.total} episodes match (newest first)`;
    body.replaceChildren(...data.episodes.map(e => el("tr", {
      "data-episode": e.id, class: e.id === this.selected ? "selected" : "",
      onclick: () => this.open(e.id)},
      el("td", {class: "mono"}, e.id.slice(0, 8)), el("td", {}, e.purpose),
      el("td", {}, Object.entries(e.roles).map(([r, p]) => `${r}: ${p}`).join(", ")),
      el("td", {}, rewardsText(e.rewards)), el("td", {}, e.turns), el("td", {}, outcome(e.summary)))));
  },

  async open(id) {
    this.selected = id;
    document.querySelectorAll("#episodes tr").forEach(tr => tr.classList.toggle("selected", tr.dataset.episode === id));
    const box = document.getElementById("episode");
    const r = await fetch("/v1/dashboard/episodes/" + encodeURIComponent(id), {headers: auth()});
    if (!r.ok) { box.replaceChildren(el("p", {class: "error"}, (await r.json()).detail)); return; }
    const ep = await r.json();
    const head = el("div", {class: "episode-head"},
      el("h3", {}, `${ep.purpose} episode `, el("span", {class: "mono"}, ep.id.slice(0, 12))),
      el("p", {}, "group ", el("span", {class: "mono"}, ep.group_id), " · players ",
        Object.entries(ep.roles).map(([r, p]) => `${r} = ${p}`).join(", ")),
      el("p", {class: "final-rewards"}, "final rewards: ", rewardsText(ep.rewards), " · ", outcome(ep.summary)));
    const parts = [head];
    if (ep.board) {
      const b = el("div", {class: "board"});
      if (ep.board.format === "html") b.innerHTML = ep.board.content; else b.append(el("pre", {}, ep.board.content));
      parts.push(b);
    }
    const rows = ep.turns.map(t => el("tr", {class: "turn", "data-turn": t.turn, "data-role": t.role},
      el("td", {}, t.turn), el("td", {}, t.role), el("td", {}, t.agent),
      el("td", {class: "mono text"}, t.text ?? (t.truncated ? "(context full: episode truncated)" : "")),
      el("td", {}, fmt(t.weight_version)), el("td", {}, fmt(t.tokens)),
      el("td", {}, rewardsText(t.turn_rewards)), el("td", {class: "tok", "data-role": t.role, "data-turn": t.turn})));
    parts.push(el("table", {class: "grid turns"},
      el("thead", {}, el("tr", {}, ...["turn", "role", "player", "text", "weights", "tokens", "turn reward", ""]
        .map(h => el("th", {}, h)))), el("tbody", {}, ...rows)));
    parts.push(el("button", {id: "show-tokens", onclick: () => this.tokens(ep.id)}, "show tokens and logprobs"));
    box.replaceChildren(...parts);
  },

  async tokens(id) {
    const r = await fetch(`/v1/dashboard/episodes/${encodeURIComponent(id)}/tokens`, {headers: auth()});
    const box = document.getElementById("episode");
    if (!r.ok) { box.append(el("p", {class: "error"}, (await r.json()).detail)); return; }
    const data = await r.json();
    for (const [role, entry] of Object.entries(data)) {
      for (const t of entry.turns) {
        const cell = box.querySelector(`td.tok[data-role="${CSS.escape(role)}"][data-turn="${t.turn}"]`);
        if (!cell) continue;
        cell.replaceChildren(...t.ids.map((id, i) => {
          const p = Math.exp(t.logprobs[i]);
          const text = t.texts ? t.texts[i] : String(id);
          return el("span", {class: "token", style: `background: rgba(37, 99, 235, ${(0.1 + 0.5 * p).toFixed(2)})`,
            title: `id ${id} · logprob ${t.logprobs[i].toFixed(4)} · p ${p.toFixed(3)} · weights v${t.weight_version}`},
            JSON.stringify(text).slice(1, -1) || "∅", el("sub", {}, t.logprobs[i].toFixed(2)));
        }));
      }
    }
    document.getElementById("show-tokens").remove();
  },
};
window.TandemTranscripts = Transcripts;
