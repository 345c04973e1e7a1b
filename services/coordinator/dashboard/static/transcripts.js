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

// What each turn earned its role: the per-turn rewards the environment gave it then, and on the role's last
// turn the rest of its final reward (the credit the trainer gives the turn: services/play/episode.py turn_credit)
function turnCredit(ep) {
  const given = {}, last = {};
  ep.turns.forEach((t, i) => {
    for (const [r, v] of Object.entries(t.turn_rewards || {})) given[r] = (given[r] || 0) + v;
    if (t.text !== undefined) last[t.role] = i;
  });
  return ep.turns.map((t, i) => {
    let own = (t.turn_rewards || {})[t.role] || 0;
    if (last[t.role] === i && typeof (ep.rewards || {})[t.role] === "number") own += ep.rewards[t.role] - (given[t.role] || 0);
    const others = Object.entries(t.turn_rewards || {}).filter(([r, v]) => r !== t.role && v);
    return [own, others];
  });
}

function creditText([own, others]) {
  const sign = v => (v > 0 ? "+" : "") + v.toFixed(2);
  return [sign(own)].concat(others.map(([r, v]) => `${r} ${sign(v)}`)).join(", ");
}

const PAGE = 40;

const Transcripts = {
  selected: null,
  offset: 0,
  shown: [],          // the ids the list shows, in order
  hovering: false,

  query() {
    const form = document.getElementById("filters");
    const q = new URLSearchParams({limit: String(PAGE), offset: String(this.offset)});
    for (const [k, v] of new FormData(form).entries()) if (v !== "") q.set(k, v);
    return q;
  },

  setOptions(info) {
    const form = document.getElementById("filters");
    for (const a of Object.keys(info.agents)) form.agent.append(el("option", {value: a}, a));
    for (const r of info.env_roles) form.role.append(el("option", {value: r}, r));
    form.addEventListener("change", () => { this.offset = 0; this.refresh(); });
    form.addEventListener("submit", ev => { ev.preventDefault(); this.refresh(); });
    document.getElementById("episodes-refresh").addEventListener("click", () => { this.offset = 0; this.refresh(); });
    const list = document.querySelector("#transcripts .list");
    list.addEventListener("mouseenter", () => { this.hovering = true; });
    list.addEventListener("mouseleave", () => { this.hovering = false; });
    const pager = el("div", {class: "pager"},
      el("button", {type: "button", id: "page-newer", onclick: () => this.page(-PAGE)}, "◀ newer"),
      el("span", {id: "page-at"}), el("button", {type: "button", id: "page-older", onclick: () => this.page(PAGE)}, "older ▶"));
    list.before(pager);
  },

  page(delta) { this.offset = Math.max(0, this.offset + delta); this.refresh(); },

  // auto: the poll's refresh. The list stays as it is while an episode is open, the pointer is over it, a
  // later page or the archive is shown: newer episodes are announced (a button), not slid in under the cursor.
  async refresh(auto = false) {
    const q = this.query();
    const frozen = auto && (this.selected !== null || this.hovering || this.offset > 0 || q.get("source") === "archive");
    if (frozen && q.get("source") === "archive") return;
    const r = await fetch("/v1/dashboard/episodes?" + q, {headers: auth()});
    if (!r.ok) {
      document.getElementById("episode-count").textContent = `filter refused: ${(await r.json()).detail}`;
      return;
    }
    const data = await r.json();
    const ids = data.episodes.map(e => e.id);
    const newer = this.shown.length ? ids.indexOf(this.shown[0]) : 0;
    if (frozen && this.shown.length) {
      const button = document.getElementById("episodes-refresh");
      button.hidden = newer === 0;
      button.textContent = newer > 0 ? `show ${newer} newer episode(s)` : "show newer episodes";
      return;
    }
    document.getElementById("episodes-refresh").hidden = true;
    this.draw(data);
  },

  draw(data) {
    const body = document.querySelector("#episodes tbody");
    const source = data.source === "archive" ? "archived" : "recent";
    const last = Math.min(this.offset + data.episodes.length, data.total);
    document.getElementById("episode-count").textContent = `${data.total} ${source} episodes match (newest first)`;
    document.getElementById("page-at").textContent = data.total ? `${this.offset + 1}–${last} of ${data.total}` : "";
    document.getElementById("page-newer").disabled = this.offset === 0;
    document.getElementById("page-older").disabled = last >= data.total;
    this.shown = data.episodes.map(e => e.id);
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
    const credit = turnCredit(ep);
    const rows = ep.turns.map((t, i) => el("tr", {class: "turn", "data-turn": t.turn, "data-role": t.role},
      el("td", {}, t.turn), el("td", {}, t.role), el("td", {}, t.agent),
      el("td", {class: "mono text"}, t.text ?? (t.truncated ? "(context full: episode truncated)" : "")),
      el("td", {}, fmt(t.weight_version)), el("td", {}, fmt(t.tokens)),
      el("td", {class: "credit", title: "what this turn earned its role: the environment's reward for the turn, " +
        "plus the rest of the final reward on the role's last turn"}, t.text === undefined ? "-" : creditText(credit[i])),
      el("td", {class: "tok", "data-role": t.role, "data-turn": t.turn})));
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
