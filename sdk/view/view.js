"use strict";
// plies view: renders the run embedded in this page. No network, no libraries. The index is
// parsed at load; a group's trajectories (a JSON block of their own) only when it is opened.
(() => {
  const $ = (id) => document.getElementById(id);
  const LIMIT_STEP = 300;
  let INDEX = null;
  let VOCAB = {};
  let parsed = new Map();
  let limit = LIMIT_STEP;
  let selected = null;

  function readData() {
    INDEX = JSON.parse($("plies-index").textContent);
    VOCAB = JSON.parse($("plies-vocab").textContent);
    parsed = new Map();
  }

  function chunk(g) {
    if (!parsed.has(g)) parsed.set(g, JSON.parse($("plies-g-" + g).textContent));
    return parsed.get(g);
  }

  const ESC = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" };
  const esc = (s) => String(s).replace(/[&<>"]/g, (c) => ESC[c]);
  function fmt(x, digits = 3) {
    if (x === null || x === undefined) return "–";
    if (typeof x === "number") return Number.isInteger(x) ? String(x) : x.toFixed(digits);
    if (typeof x === "object") return esc(JSON.stringify(x));
    return esc(x);
  }
  const num = (x) => typeof x === "number";

  function flatten(obj, prefix = "", out = []) {
    for (const [k, v] of Object.entries(obj || {})) {
      if (v && typeof v === "object" && !Array.isArray(v)) flatten(v, prefix + k + ".", out);
      else out.push([prefix + k, v]);
    }
    return out;
  }

  function kvTable(id, obj) {
    const rows = flatten(obj).map(([k, v]) => `<tr><th>${esc(k)}</th><td>${fmt(v, 4)}</td></tr>`);
    return `<table id="${id}">${rows.join("")}</table>`;
  }

  // Any JSON value as a table: a list of objects, an object of objects, or key -> value.
  function jsonTable(id, value) {
    if (Array.isArray(value) && value.every((r) => r && typeof r === "object")) {
      const cols = [...new Set(value.flatMap((r) => Object.keys(r)))];
      const head = cols.map((c) => `<th>${esc(c)}</th>`).join("");
      const body = value.map((r) => "<tr>" + cols.map((c) => cell(r[c])).join("") + "</tr>");
      return `<table id="${id}"><tr>${head}</tr>${body.join("")}</table>`;
    }
    if (value && typeof value === "object" && !Array.isArray(value)) {
      const rows = Object.entries(value);
      if (rows.length && rows.every(([, v]) => v && typeof v === "object" && !Array.isArray(v))) {
        const cols = [...new Set(rows.flatMap(([, v]) => Object.keys(v)))];
        const head = "<th></th>" + cols.map((c) => `<th>${esc(c)}</th>`).join("");
        const body = rows.map(([k, v]) => `<tr><th>${esc(k)}</th>` + cols.map((c) => cell(v[c])).join("") + "</tr>");
        return `<table id="${id}"><tr>${head}</tr>${body.join("")}</table>`;
      }
      return kvTable(id, value);
    }
    return `<div id="${id}">${fmt(value)}</div>`;
  }
  const cell = (v) => `<td class="${num(v) ? "num" : ""}">${fmt(v, 4)}</td>`;

  // -- the run ---------------------------------------------------------------------------

  function header() {
    const live = INDEX.live ? ` · <span class="live" id="live">live</span>` : "";
    const when = new Date(INDEX.generated * 1000).toLocaleString();
    const tok = INDEX.tokenizer ? esc(INDEX.tokenizer) : "none";
    return `<h1>plies view</h1><div class="muted"><span id="run-dir">${esc(INDEX.dir)}</span> · read ${esc(when)} · tokenizer ${tok}${live}</div>`;
  }

  function problems() {
    if (!INDEX.problems.length) return "";
    const items = INDEX.problems.map((p) => `<li>${esc(p)}</li>`).join("");
    return `<div class="problems" id="problems"><h2>What is missing or damaged</h2><ul>${items}</ul></div>`;
  }

  function summaryCards(s) {
    const keys = ["warm_start_return", "final_return", "improvement", "eval_hands", "grpo_steps", "policies", "minutes", "complete"];
    const cards = keys.filter((k) => k in s).map((k) => `<div class="card"><span class="muted">${esc(k)}</span><b data-key="${esc(k)}">${fmt(s[k])}</b></div>`);
    return `<div class="cards" id="summary-cards">${cards.join("")}</div>`;
  }

  function runSection() {
    const s = INDEX.summary;
    const parts = [`<section id="run"><h2>The run</h2>`];
    if (s) {
      parts.push(summaryCards(s));
      if (s.strategy !== undefined) parts.push(`<h3>Strategy</h3>` + jsonTable("strategy", s.strategy));
      const rest = Object.fromEntries(Object.entries(s).filter(([k]) => k !== "strategy"));
      parts.push(`<details><summary>summary.json</summary>${kvTable("summary", rest)}</details>`);
    } else {
      parts.push(`<p class="muted" id="summary">No summary yet.</p>`);
    }
    if (INDEX.run) parts.push(`<details><summary>options (run.json)</summary>${kvTable("config", INDEX.run)}</details>`);
    parts.push(`<h3>Learning curve</h3>${curve()}`);
    parts.push(`<h3>Steps</h3>${stepsTable()}`);
    parts.push(`<h3>Policies published</h3>${jsonTable("policies", INDEX.policies)}`);
    if (INDEX.quarantine) {
      const q = INDEX.quarantine;
      const entries = q.entries && q.entries.length ? jsonTable("quarantine-entries", q.entries) : `<span class="muted">none</span>`;
      parts.push(`<h3>Quarantine report</h3><div id="quarantine">complete: ${fmt(q.complete)} · entries: ${entries}</div>`);
    }
    parts.push("</section>");
    return parts.join("");
  }

  function band(e) {
    const ci = e.ci || e.return_ci;
    if (Array.isArray(ci) && ci.length === 2 && num(ci[0]) && num(ci[1])) return ci;
    if (num(e.stderr)) return [e.return - 1.96 * e.stderr, e.return + 1.96 * e.stderr];
    return null;
  }

  function curve() {
    const evals = INDEX.evals.filter((e) => num(e.step) && num(e.return)).sort((a, b) => a.step - b.step);
    const train = INDEX.steps.filter((s) => num(s.step) && num(s.train_return));
    const refs = (INDEX.summary && INDEX.summary.references) || {};
    if (!evals.length && !train.length) return `<p class="muted" id="curve">No evaluations recorded yet.</p>`;
    const W = 680, H = 270, L = 48, R = 120, T = 24, B = 30;
    const ys = [...evals.map((e) => e.return), ...train.map((s) => s.train_return), ...Object.values(refs).filter(num)];
    for (const e of evals) { const b = band(e); if (b) ys.push(...b); }
    const xs = [...evals.map((e) => e.step), ...train.map((s) => s.step + 1)];
    let y0 = Math.min(...ys), y1 = Math.max(...ys);
    if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }
    const x0 = Math.min(0, ...xs), x1 = Math.max(1, ...xs);
    const X = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
    const Y = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
    const out = [`<svg id="curve" width="${W}" height="${H}" viewBox="0 0 ${W} ${H}" role="img">`];
    out.push(`<line x1="${L}" y1="${H - B}" x2="${W - R}" y2="${H - B}" stroke="#999"/><line x1="${L}" y1="${T}" x2="${L}" y2="${H - B}" stroke="#999"/>`);
    for (const y of [y0, (y0 + y1) / 2, y1]) out.push(`<text x="${L - 4}" y="${Y(y) + 4}" text-anchor="end">${y.toFixed(2)}</text>`);
    const uniq = [...new Set([x0, ...xs])].sort((a, b) => a - b);
    const ticks = uniq.length <= 12 ? uniq : Array.from({ length: 11 }, (_, i) => Math.round(x0 + (i * (x1 - x0)) / 10));
    for (const x of ticks) out.push(`<text x="${X(x)}" y="${H - B + 14}" text-anchor="middle">${x}</text>`);
    out.push(`<text x="${(L + W - R) / 2}" y="${H - 2}" text-anchor="middle">step</text>`);
    for (const [name, v] of Object.entries(refs)) {
      if (!num(v)) continue;
      out.push(`<line x1="${L}" x2="${W - R}" y1="${Y(v)}" y2="${Y(v)}" stroke="#bbb" stroke-dasharray="3 3"/><text x="${W - R + 4}" y="${Y(v) + 4}">${esc(name)} ${v}</text>`);
    }
    const banded = evals.map((e) => [e, band(e)]).filter(([, b]) => b);
    if (banded.length) {
      const top = banded.map(([e, b]) => `${X(e.step)},${Y(b[1])}`);
      const bottom = banded.slice().reverse().map(([e, b]) => `${X(e.step)},${Y(b[0])}`);
      out.push(`<polygon id="curve-band" points="${[...top, ...bottom].join(" ")}" fill="#2563eb" opacity="0.15"/>`);
    }
    if (train.length) {
      const pts = train.map((s) => `${X(s.step + 1)},${Y(s.train_return)}`).join(" ");
      out.push(`<polyline points="${pts}" fill="none" stroke="#d97706" stroke-dasharray="4 2"/>`);
    }
    if (evals.length) {
      const pts = evals.map((e) => `${X(e.step)},${Y(e.return)}`).join(" ");
      out.push(`<polyline points="${pts}" fill="none" stroke="#2563eb" stroke-width="2"/>`);
      for (const e of evals) {
        out.push(`<circle class="pt" data-step="${e.step}" data-return="${e.return}" cx="${X(e.step)}" cy="${Y(e.return)}" r="3.5" fill="#2563eb"><title>${esc(e.label || "eval")} step ${e.step}: ${e.return.toFixed(3)} over ${fmt(e.hands)} hands</title></circle>`);
      }
    }
    out.push(`<text x="${L + 6}" y="11" fill="#2563eb">— evaluation return${banded.length ? " (band: 95% interval)" : ""}</text>`);
    if (train.length) out.push(`<text x="${L + 250}" y="11" fill="#d97706">- - train return (after the step)</text>`);
    out.push("</svg>");
    return out.join("");
  }

  function stepsTable() {
    if (!INDEX.steps.length) return `<p class="muted" id="steps">No training steps recorded yet.</p>`;
    const skip = new Set(["kind", "time", "step", "policy", "groups", "refused"]);
    const cols = [...new Set(INDEX.steps.flatMap((s) => Object.keys(s).filter((k) => !skip.has(k) && (num(s[k]) || s[k] === null))))];
    // Read off the step's groups: what the step trained on, not what the recipe logged.
    const derived = ["staleness", "ill-formed turns", "fallbacks"];
    const byId = new Map(INDEX.groups.map((g) => [g.id, g]));
    const head = ["step", "policy", "groups", ...cols, ...derived, "refused"].map((c) => `<th>${esc(c)}</th>`).join("");
    const warm = INDEX.policies.find((p) => p.first === "warm_start");
    let before = warm ? warm.version : null; // the policy a step trained from: the one before it
    const rows = INDEX.steps.map((s) => {
      const reasons = {};
      for (const r of s.refused || []) { const why = String(r).split(": ").pop(); reasons[why] = (reasons[why] || 0) + 1; }
      const refused = Object.entries(reasons).map(([why, n]) => `${esc(why)} ×${n}`).join("<br>") || "–";
      const v = s.policy && num(s.policy.version) ? s.policy.version : null;
      const groups = (s.groups || []).map((id) => byId.get(id)).filter(Boolean);
      const lag = groups.length && before !== null ? Math.max(...groups.map((g) => before - g.v)) : null;
      before = v;
      const ill = groups.reduce((a, g) => a + g.members.reduce((b, m) => b + m.ill, 0), 0);
      const fb = groups.reduce((a, g) => a + g.members.reduce((b, m) => b + m.fb, 0), 0);
      const cells = cols.map((c) => `<td class="num">${fmt(s[c], 4)}</td>`).join("");
      const extra = [lag, groups.length ? ill : null, groups.length ? fb : null].map((x) => `<td class="num">${fmt(x)}</td>`).join("");
      return `<tr data-step="${s.step}"><td class="num">${fmt(s.step)}</td><td>${v === null ? "–" : "v" + v}</td><td class="num">${(s.groups || []).length}</td>${cells}${extra}<td title="${esc((s.refused || []).join("\n"))}">${refused}</td></tr>`;
    });
    return `<div class="scroll short"><table id="steps"><tr>${head}</tr>${rows.join("")}</table></div>`;
  }

  // -- episodes ----------------------------------------------------------------------------

  function episodesSection() {
    const statuses = [...new Set(INDEX.groups.flatMap((g) => g.members.map((m) => m.status)))].filter(Boolean).sort();
    const options = statuses.map((s) => `<option value="${esc(s)}">${esc(s)}</option>`).join("");
    return `<section id="episodes"><h2>Steps, groups, episodes</h2>
      <div class="filters">
        <label>task <input id="f-task" placeholder="task id contains"></label>
        <label>status <select id="f-status"><option value="">any</option>${options}</select></label>
        <label>reward ≥ <input id="f-rmin" type="number" step="any"></label>
        <label>≤ <input id="f-rmax" type="number" step="any"></label>
        <label><input id="f-fallback" type="checkbox"> with a fallback</label>
        <label><input id="f-ill" type="checkbox"> ill-formed</label>
        <label><input id="f-refused" type="checkbox"> refused or untrained</label>
        <span id="f-count" class="muted"></span>
      </div>
      <div class="grid"><div class="scroll" id="browser"><table id="members"></table><p><button id="more" hidden>show more</button></p></div>
      <div id="traj" class="muted">Pick an episode on the left.</div></div></section>`;
  }

  function filters() {
    const n = (id) => ($(id).value === "" ? null : Number($(id).value));
    return {
      task: $("f-task").value.trim(), status: $("f-status").value, rmin: n("f-rmin"), rmax: n("f-rmax"),
      fallback: $("f-fallback").checked, ill: $("f-ill").checked, refused: $("f-refused").checked,
    };
  }

  function matches(f, g, m) {
    if (f.task && !g.task.includes(f.task)) return false;
    if (f.status && m.status !== f.status) return false;
    if (f.rmin !== null && !(num(m.reward) && m.reward >= f.rmin)) return false;
    if (f.rmax !== null && !(num(m.reward) && m.reward <= f.rmax)) return false;
    if (f.fallback && !m.fb) return false;
    if (f.ill && !m.ill && m.stop !== "ill_formed") return false;
    if (f.refused && g.step !== null && !g.refused) return false;
    return true;
  }

  const stepOrder = (g) => (g.step === null ? Infinity : g.step);

  function statusTag(s) {
    const cls = s === "completed" ? "ok" : s === "truncated" ? "warn" : "bad";
    return `<span class="tag ${cls}">${esc(s || "open")}</span>`;
  }

  function groupVerdict(g) {
    if (g.step === null) return `<span class="tag warn">not trained</span>`;
    if (g.refused) return `<span class="tag bad">refused: ${esc(g.refused)}</span>`;
    return `<span class="tag ok">trained in step ${g.step}</span>`;
  }

  function renderMembers() {
    const f = filters();
    const groups = INDEX.groups.slice().sort((a, b) => stepOrder(a) - stepOrder(b) || a.line - b.line);
    const rows = [];
    let shown = 0, matched = 0, total = 0, lastStep;
    const head = `<tr><th>#</th><th class="num">reward</th><th class="num">adv</th><th>status</th><th>stop</th><th class="num">turns</th><th>marks</th></tr>`;
    for (const g of groups) {
      const hits = g.members.filter((m) => matches(f, g, m));
      total += g.members.length;
      matched += hits.length;
      if (!hits.length || shown >= limit) continue;
      if (stepOrder(g) !== lastStep) {
        lastStep = stepOrder(g);
        const label = g.step === null ? "not trained (yet)" : `step ${g.step}`;
        rows.push(`<tr class="shead"><td colspan="7">${label}</td></tr>`);
      }
      rows.push(`<tr class="ghead" data-group="${esc(g.id)}"><td colspan="7">group <b>${esc(g.id)}</b> · task ${esc(g.task)} · policy v${g.v} · ${g.members.length}/${g.size} · ${groupVerdict(g)}</td></tr>`);
      for (const m of hits) {
        if (shown >= limit) break;
        shown += 1;
        const marks = [
          m.ill ? `<span class="tag bad">ill-formed ×${m.ill}</span>` : "",
          m.fb ? `<span class="tag warn">fallback ×${m.fb}</span>` : "",
          m.q ? `<span class="tag bad">quarantined leases ×${m.q}</span>` : "",
          m.error ? `<span class="tag bad" title="${esc(m.error)}">error</span>` : "",
        ].join(" ");
        const sel = selected && selected[0] === g.i && selected[1] === m.m ? " sel" : "";
        rows.push(`<tr class="member${sel}" data-g="${g.i}" data-m="${m.m}" data-task="${esc(g.task)}"><td>${m.m}</td><td class="num">${fmt(m.reward)}</td><td class="num">${fmt(m.adv)}</td><td>${statusTag(m.status)}</td><td>${fmt(m.stop)}</td><td class="num">${m.turns}</td><td>${marks}</td></tr>`);
      }
    }
    $("members").innerHTML = head + rows.join("");
    const count = $("f-count");
    count.textContent = `${matched} of ${total} episodes` + (matched > shown ? ` (first ${shown} shown)` : "");
    count.dataset.matched = matched;
    count.dataset.shown = shown;
    $("more").hidden = matched <= shown;
  }

  // -- one trajectory ----------------------------------------------------------------------

  function heat(lp) {
    const p = Math.exp(lp);
    return `hsl(${Math.round(120 * p)},75%,80%)`;
  }

  function tokText(id) {
    const t = VOCAB[id];
    return t === undefined ? `⟨${id}⟩` : t;
  }

  function tokens(ids, lps) {
    const out = [];
    for (let i = 0; i < ids.length; i++) {
      const id = ids[i];
      const text = tokText(id);
      const special = /^<\|?[^<>\s]*\|?>$/.test(text) ? " special" : "";
      const shown = esc(text).replace(/\n/g, "↵\n");
      if (lps) {
        const lp = lps[i];
        const p = num(lp) ? Math.exp(lp) : NaN;
        out.push(`<span class="tok c${special}" data-id="${id}" data-mask="1" data-lp="${lp}" style="background:${num(lp) ? heat(lp) : "#f88"}" title="id ${id} · logprob ${lp} · p ${p.toFixed(3)}">${shown}</span>`);
      } else {
        out.push(`<span class="tok p${special}" data-id="${id}" data-mask="0" title="id ${id}">${shown}</span>`);
      }
    }
    return out.join("");
  }

  // The env's side of each turn: the messages after the turn's assistant message.
  function replies(messages) {
    const byTurn = [];
    let k = -1;
    for (const msg of messages || []) {
      if (msg.role === "assistant") { k += 1; byTurn[k] = []; continue; }
      if (k >= 0) byTurn[k].push(msg);
    }
    return byTurn;
  }

  function showMember(g, m) {
    const grp = INDEX.groups[g];
    if (!grp || !grp.members[m]) return;
    selected = [g, m];
    for (const tr of document.querySelectorAll("tr.member.sel")) tr.classList.remove("sel");
    const tr = document.querySelector(`tr.member[data-g="${g}"][data-m="${m}"]`);
    if (tr) tr.classList.add("sel");
    history.replaceState(null, "", `#g=${g}&m=${m}`);
    const row = grp.members[m];
    const data = chunk(g).members[m];
    const out = [`<h3 id="traj-title">group ${esc(grp.id)} · member ${m} · task ${esc(row.task)}</h3>`];
    out.push(`<div>${statusTag(row.status)} stop: <b>${fmt(row.stop)}</b> · reward <b id="traj-reward">${fmt(row.reward)}</b> · advantage <b>${fmt(row.adv)}</b> · ${groupVerdict(grp)}</div>`);
    if (data.error) out.push(`<div class="tag bad">${esc(data.error)}</div>`);
    const info = data.info || {};
    if (info.quarantined_leases) out.push(`<h3>Quarantined leases</h3>` + jsonTable("traj-quarantined", info.quarantined_leases));
    if (info.ill_formed) out.push(`<div class="env">ill-formed: ${esc(JSON.stringify(info.ill_formed))}</div>`);
    if (info.env) out.push(`<div class="env">env: ${esc(JSON.stringify(info.env))}</div>`);
    out.push(`<div class="legend muted">prompt tokens <span class="tok p">grey</span> · sampled tokens (trained on) coloured by sampler probability: ${[0.02, 0.2, 0.5, 0.8, 1].map((p) => `<span style="background:${heat(Math.log(p))}">${p}</span>`).join("")}</div>`);
    const env = replies(data.messages);
    data.turns.forEach((t, k) => {
      const marks = [
        t.fb ? `<span class="tag warn fallback">fallback: ${esc(t.fb)}</span>` : "",
        t.ill ? `<span class="tag bad">ill-formed</span>` : "",
      ].join(" ");
      const label = t.x ? `prompt delta, ${t.p.length} new tokens` : `full prompt, ${t.p.length} tokens${k ? " (re-rendered)" : ""}`;
      const calls = ((t.msg && t.msg.tool_calls) || []).map((c) => `${c.function.name}(${JSON.stringify(c.function.arguments)})`);
      const results = (env[k] || []).map((r) => `${r.role}${r.name ? " " + r.name : ""}: ${r.content}`);
      out.push(`<div class="turn${t.ill ? " ill" : ""}" data-turn="${k}">
        <div class="head">turn ${k} · policy <b class="version">v${t.v}</b> · finish ${esc(t.f)} · ${fmt(t.lat, 2)} s ${marks}</div>
        <div class="muted">${label}</div><div class="toks prompt">${tokens(t.p, null)}</div>
        <div class="muted">completion, ${t.c.length} sampled tokens</div><div class="toks completion">${tokens(t.c, t.l)}</div>
        ${calls.length ? `<div class="env calls">tool calls: ${esc(calls.join(", "))}</div>` : ""}
        ${results.length ? `<div class="env results">${esc(results.join("\n"))}</div>` : ""}
      </div>`);
    });
    $("traj").className = "";
    $("traj").innerHTML = out.join("");
  }

  // -- wiring ------------------------------------------------------------------------------

  function fromHash() {
    const m = /g=(\d+)&m=(\d+)/.exec(location.hash);
    return m ? [Number(m[1]), Number(m[2])] : null;
  }

  function render(keep) {
    const app = $("app");
    app.innerHTML = header() + problems() + runSection() + episodesSection();
    if (keep) for (const [id, v] of Object.entries(keep)) { const el = $(id); if (el) el[typeof v === "boolean" ? "checked" : "value"] = v; }
    for (const id of ["f-task", "f-status", "f-rmin", "f-rmax", "f-fallback", "f-ill", "f-refused"]) {
      $(id).addEventListener("input", () => { limit = LIMIT_STEP; renderMembers(); });
      $(id).addEventListener("change", () => { limit = LIMIT_STEP; renderMembers(); });
    }
    $("more").addEventListener("click", () => { limit += LIMIT_STEP; renderMembers(); });
    $("members").addEventListener("click", (ev) => {
      const tr = ev.target.closest("tr.member");
      if (tr) showMember(Number(tr.dataset.g), Number(tr.dataset.m));
    });
    renderMembers();
    const want = selected || fromHash();
    if (want) showMember(want[0], want[1]);
  }

  function filterState() {
    const keep = {};
    for (const id of ["f-task", "f-status", "f-rmin", "f-rmax"]) keep[id] = $(id).value;
    for (const id of ["f-fallback", "f-ill", "f-refused"]) keep[id] = $(id).checked;
    return keep;
  }

  async function poll(stamp) {
    try {
      const now = await (await fetch("stamp", { cache: "no-store" })).text();
      if (now !== stamp) {
        const html = await (await fetch("page", { cache: "no-store" })).text();
        const doc = new DOMParser().parseFromString(html, "text/html");
        for (const old of document.querySelectorAll('script[type="application/json"]')) old.remove();
        const anchor = document.querySelector("script:not([type])");
        for (const s of doc.querySelectorAll('script[type="application/json"]')) {
          const fresh = document.createElement("script");
          fresh.type = "application/json";
          fresh.id = s.id;
          fresh.textContent = s.textContent;
          document.body.insertBefore(fresh, anchor);
        }
        const keep = filterState();
        readData();
        render(keep);
        stamp = now;
      }
      $("live").textContent = "live · checked " + new Date().toLocaleTimeString();
    } catch (err) {
      const el = $("live");
      if (el) el.textContent = "live · server unreachable";
    }
    setTimeout(() => poll(stamp), 2000);
  }

  function main() {
    try {
      readData();
    } catch (err) {
      $("app").innerHTML = `<div class="problems" id="problems"><h2>This page's data does not read</h2><p>${esc(err)}</p></div>`;
      return;
    }
    render(null);
    window.plies = { ready: performance.now(), select: showMember };
    document.body.dataset.ready = "1";
    if (INDEX.live) setTimeout(() => poll(INDEX.stamp || ""), 2000);
  }

  main();
})();
