"use strict";
// plies view: renders the run embedded in this page. No network, no libraries, no innerHTML:
// every element is built with the DOM and every value a run wrote goes in as text or as an
// attribute value (h() below), so nothing in a run directory can become markup or script.
// The index is inflated at load; a chunk of groups' trajectories only when one is opened.
(() => {
  const $ = (id) => document.getElementById(id);
  const SVG = "http://www.w3.org/2000/svg";
  const LIMIT_STEP = 300;
  let INDEX = null;
  let VOCAB = {};
  let inflated = new Map();
  let limit = LIMIT_STEP;
  let selected = null;

  // -- building elements -----------------------------------------------------------------

  function build(el, attrs, kids) {
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") el.setAttribute("class", String(v));
      else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
      else el.setAttribute(k, String(v));
    }
    for (const kid of kids.flat(Infinity)) {
      if (kid === null || kid === undefined || kid === false || kid === "") continue;
      el.append(kid instanceof Node ? kid : String(kid)); // a string is a text node, always
    }
    return el;
  }
  const h = (tag, attrs, ...kids) => build(document.createElement(tag), attrs, kids);
  const s = (tag, attrs, ...kids) => build(document.createElementNS(SVG, tag), attrs, kids);
  const replace = (el, ...kids) => { el.replaceChildren(); build(el, {}, kids); return el; };

  async function inflate(id) {
    const b64 = $(id).textContent;
    const bin = atob(b64);
    const bytes = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
    const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
    return JSON.parse(await new Response(stream).text());
  }

  async function readData() {
    INDEX = await inflate("plies-index");
    VOCAB = JSON.parse($("plies-vocab").textContent);
    inflated = new Map();
  }

  async function groupData(g) {
    const [c, k] = INDEX.groups[g].c;
    if (!inflated.has(c)) inflated.set(c, inflate("plies-c-" + c));
    return (await inflated.get(c))[k];
  }

  function fmt(x, digits = 3) {
    if (x === null || x === undefined) return "–";
    if (typeof x === "number") return Number.isInteger(x) ? String(x) : x.toFixed(digits);
    if (typeof x === "object") return JSON.stringify(x);
    return String(x);
  }
  const num = (x) => typeof x === "number" && Number.isFinite(x);
  const int = (x) => Number.isInteger(x);

  function flatten(obj, prefix = "", out = []) {
    for (const [k, v] of Object.entries(obj || {})) {
      if (v && typeof v === "object" && !Array.isArray(v)) flatten(v, prefix + k + ".", out);
      else out.push([prefix + k, v]);
    }
    return out;
  }

  const kvTable = (id, obj) => h("table", { id }, flatten(obj).map(([k, v]) => h("tr", {}, h("th", {}, k), h("td", {}, fmt(v, 4)))));
  const cell = (v) => h("td", { class: num(v) ? "num" : "" }, fmt(v, 4));

  // Any JSON value as a table: a list of objects, an object of objects, or key -> value.
  function jsonTable(id, value) {
    if (Array.isArray(value) && value.every((r) => r && typeof r === "object")) {
      const cols = [...new Set(value.flatMap((r) => Object.keys(r)))];
      return h("table", { id }, h("tr", {}, cols.map((c) => h("th", {}, c))), value.map((r) => h("tr", {}, cols.map((c) => cell(r[c])))));
    }
    if (value && typeof value === "object" && !Array.isArray(value)) {
      const rows = Object.entries(value);
      if (rows.length && rows.every(([, v]) => v && typeof v === "object" && !Array.isArray(v))) {
        const cols = [...new Set(rows.flatMap(([, v]) => Object.keys(v)))];
        return h("table", { id }, h("tr", {}, h("th", {}), cols.map((c) => h("th", {}, c))),
          rows.map(([k, v]) => h("tr", {}, h("th", {}, k), cols.map((c) => cell(v[c])))));
      }
      return kvTable(id, value);
    }
    return h("div", { id }, fmt(value));
  }

  // -- the run ---------------------------------------------------------------------------

  function header() {
    const when = new Date(INDEX.generated * 1000).toLocaleString();
    return [h("h1", {}, "plies view"), h("div", { class: "muted" },
      h("span", { id: "run-dir" }, INDEX.dir), " · read ", when, " · tokenizer ", INDEX.tokenizer || "none",
      INDEX.live ? [" · ", h("span", { class: "live", id: "live" }, "live")] : null)];
  }

  function problems() {
    if (!INDEX.problems.length) return null;
    return h("div", { class: "problems", id: "problems" }, h("h2", {}, "What is missing or damaged"),
      h("ul", {}, INDEX.problems.map((p) => h("li", {}, p))));
  }

  function summaryCards(sm) {
    const keys = ["warm_start_return", "final_return", "improvement", "eval_hands", "grpo_steps", "policies", "minutes", "complete"];
    return h("div", { class: "cards", id: "summary-cards" }, keys.filter((k) => k in sm).map((k) =>
      h("div", { class: "card" }, h("span", { class: "muted" }, k), h("b", { "data-key": k }, fmt(sm[k])))));
  }

  // The strategy as the classic chart (strategy.png): rows are player totals, columns the
  // dealer's up card, each cell coloured by how often the policy hit there (red: always,
  // green: never), with the number of decisions and the optimal move.
  function isChart(st) {
    const ok = (rows) => rows && typeof rows === "object" && Object.values(rows).every((r) =>
      r && typeof r === "object" && Object.values(r).every((c) => c && typeof c === "object" && "hit_rate" in c));
    return st && typeof st === "object" && ok(st.hard) && (st.soft === undefined || ok(st.soft));
  }

  function chart(kind, rows) {
    const ups = [...new Set(Object.values(rows).flatMap((r) => Object.keys(r)))];
    const label = (t) => (kind === "soft" && /^\d+$/.test(t) ? "A+" + (Number(t) - 11) : t);
    return h("table", { class: "chart", id: "strategy-" + kind },
      h("caption", {}, kind + " totals: hit share (decisions); ", h("span", { class: "opt" }, "H"), "/", h("span", { class: "opt" }, "S"), " optimal"),
      h("tr", {}, h("th", {}, "total \\ up"), ups.map((u) => h("th", {}, u))),
      Object.entries(rows).map(([t, r]) => h("tr", { "data-total": t }, h("th", {}, label(t)), ups.map((u) => {
        const c = r[u] || {};
        const rate = num(c.hit_rate) ? Math.min(1, Math.max(0, c.hit_rate)) : null;
        const style = rate === null ? null : `background:hsl(${Math.round(120 * (1 - rate))},70%,72%)`;
        const opt = c.optimal === "hit" ? "H" : c.optimal === "stand" ? "S" : "";
        return h("td", { class: "cell", style, "data-up": u, "data-rate": rate === null ? "" : rate, title: `${label(t)} against ${u}: hit ${fmt(c.hit_rate)} of ${fmt(c.decisions)} decisions; optimal ${fmt(c.optimal)}` },
          rate === null ? "" : rate.toFixed(2), h("small", {}, int(c.decisions) && c.decisions ? ` ${c.decisions}` : ""), h("span", { class: "opt" }, opt));
      }))));
  }

  function strategy(st) {
    if (!isChart(st)) return [h("h3", {}, "Strategy"), jsonTable("strategy", st)];
    const note = [st.policy ? `policy: ${fmt(st.policy)}` : "", st.how ? fmt(st.how) : ""].filter(Boolean).join(" · ");
    return [h("h3", {}, "Strategy"), h("div", { class: "muted" }, note),
      h("div", { class: "charts", id: "strategy" }, chart("hard", st.hard), st.soft ? chart("soft", st.soft) : null)];
  }

  function runSection() {
    const sm = INDEX.summary;
    const out = h("section", { id: "run" }, h("h2", {}, "The run"));
    if (sm) out.append(summaryCards(sm));
    build(out, {}, [h("h3", {}, "Learning curve"), curve()]);
    if (sm) {
      if (sm.strategy !== undefined && sm.strategy !== null) build(out, {}, strategy(sm.strategy));
      const rest = Object.fromEntries(Object.entries(sm).filter(([k]) => k !== "strategy"));
      out.append(h("details", {}, h("summary", {}, "summary.json"), kvTable("summary", rest)));
    } else {
      out.append(h("p", { class: "muted", id: "summary" }, "No summary yet."));
    }
    if (INDEX.run) out.append(h("details", {}, h("summary", {}, "options (run.json)"), kvTable("config", INDEX.run)));
    build(out, {}, [h("h3", {}, "Steps"), stepsTable(), h("h3", {}, "Policies published"), jsonTable("policies", INDEX.policies)]);
    if (INDEX.quarantine) {
      const q = INDEX.quarantine;
      const entries = q.entries && q.entries.length ? jsonTable("quarantine-entries", q.entries) : h("span", { class: "muted" }, "none");
      build(out, {}, [h("h3", {}, "Quarantine report"), h("div", { id: "quarantine" }, "complete: ", fmt(q.complete), " · entries: ", entries)]);
    }
    return out;
  }

  function band(e) {
    const ci = e.ci || e.return_ci;
    if (Array.isArray(ci) && ci.length === 2 && num(ci[0]) && num(ci[1])) return ci;
    if (num(e.stderr)) return [e.return - 1.96 * e.stderr, e.return + 1.96 * e.stderr];
    return null;
  }

  function curve() {
    const evals = INDEX.evals.filter((e) => num(e.step) && num(e.return)).sort((a, b) => a.step - b.step);
    const train = INDEX.steps.filter((st) => num(st.step) && num(st.train_return));
    const refs = (INDEX.summary && INDEX.summary.references) || {};
    if (!evals.length && !train.length) return h("p", { class: "muted", id: "curve" }, "No evaluations recorded yet.");
    const W = 680, H = 270, L = 48, R = 120, T = 24, B = 30;
    const ys = [...evals.map((e) => e.return), ...train.map((st) => st.train_return), ...Object.values(refs).filter(num)];
    for (const e of evals) { const b = band(e); if (b) ys.push(...b); }
    const xs = [...evals.map((e) => e.step), ...train.map((st) => st.step + 1)];
    let y0 = Math.min(...ys), y1 = Math.max(...ys);
    if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }
    const x0 = Math.min(0, ...xs), x1 = Math.max(1, ...xs);
    const X = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
    const Y = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
    const g = s("svg", { id: "curve", width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: "img" },
      s("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#999" }), s("line", { x1: L, y1: T, x2: L, y2: H - B, stroke: "#999" }));
    for (const y of [y0, (y0 + y1) / 2, y1]) g.append(s("text", { x: L - 4, y: Y(y) + 4, "text-anchor": "end" }, y.toFixed(2)));
    const uniq = [...new Set([x0, ...xs])].sort((a, b) => a - b);
    const ticks = uniq.length <= 12 ? uniq : Array.from({ length: 11 }, (_, i) => Math.round(x0 + (i * (x1 - x0)) / 10));
    for (const x of ticks) g.append(s("text", { x: X(x), y: H - B + 14, "text-anchor": "middle" }, x));
    g.append(s("text", { x: (L + W - R) / 2, y: H - 2, "text-anchor": "middle" }, "step"));
    for (const [name, v] of Object.entries(refs)) {
      if (!num(v)) continue;
      g.append(s("line", { x1: L, x2: W - R, y1: Y(v), y2: Y(v), stroke: "#bbb", "stroke-dasharray": "3 3" }), s("text", { x: W - R + 4, y: Y(v) + 4 }, `${name} ${v}`));
    }
    const banded = evals.map((e) => [e, band(e)]).filter(([, b]) => b);
    if (banded.length) {
      const top = banded.map(([e, b]) => `${X(e.step)},${Y(b[1])}`);
      const bottom = banded.slice().reverse().map(([e, b]) => `${X(e.step)},${Y(b[0])}`);
      g.append(s("polygon", { id: "curve-band", points: [...top, ...bottom].join(" "), fill: "#2563eb", opacity: 0.15 }));
    }
    if (train.length) g.append(s("polyline", { points: train.map((st) => `${X(st.step + 1)},${Y(st.train_return)}`).join(" "), fill: "none", stroke: "#d97706", "stroke-dasharray": "4 2" }));
    if (evals.length) {
      g.append(s("polyline", { points: evals.map((e) => `${X(e.step)},${Y(e.return)}`).join(" "), fill: "none", stroke: "#2563eb", "stroke-width": 2 }));
      for (const e of evals) {
        g.append(s("circle", { class: "pt", "data-step": e.step, "data-return": e.return, cx: X(e.step), cy: Y(e.return), r: 3.5, fill: "#2563eb" },
          s("title", {}, `${fmt(e.label || "eval")} step ${e.step}: ${e.return.toFixed(3)} over ${fmt(e.episodes ?? e.hands)} episodes`)));
      }
    }
    g.append(s("text", { x: L + 6, y: 11, fill: "#2563eb" }, "— evaluation return" + (banded.length ? " (band: 95% interval)" : "")));
    if (train.length) g.append(s("text", { x: L + 250, y: 11, fill: "#d97706" }, "- - train return (after the step)"));
    return g;
  }

  function stepsTable() {
    if (!INDEX.steps.length) return h("p", { class: "muted", id: "steps" }, "No training steps recorded yet.");
    const skip = new Set(["kind", "time", "step", "policy", "groups", "refused"]);
    const cols = [...new Set(INDEX.steps.flatMap((st) => Object.keys(st).filter((k) => !skip.has(k) && (num(st[k]) || st[k] === null))))];
    // Read off the step's groups: what the step trained on, not what the recipe logged.
    const derived = ["staleness", "ill-formed turns", "fallbacks"];
    const byId = new Map(INDEX.groups.map((g) => [g.id, g]));
    const warm = INDEX.policies.find((p) => p.first === "warm_start");
    let before = warm ? warm.version : null; // the policy a step trained from: the one before it
    const rows = INDEX.steps.map((st) => {
      const reasons = {};
      for (const r of st.refused || []) { const why = String(r).split(": ").pop(); reasons[why] = (reasons[why] || 0) + 1; }
      const refused = Object.entries(reasons).map(([why, n]) => `${why} ×${n}`).join("\n") || "–";
      const v = st.policy && int(st.policy.version) ? st.policy.version : null;
      const groups = (st.groups || []).map((id) => byId.get(id)).filter(Boolean);
      const lag = groups.length && before !== null ? Math.max(...groups.map((g) => before - g.v)) : null;
      before = v;
      const ill = groups.reduce((a, g) => a + g.members.reduce((b, m) => b + m.ill, 0), 0);
      const fb = groups.reduce((a, g) => a + g.members.reduce((b, m) => b + m.fb, 0), 0);
      return h("tr", { "data-step": st.step }, h("td", { class: "num" }, fmt(st.step)), h("td", {}, v === null ? "–" : "v" + v),
        h("td", { class: "num" }, (st.groups || []).length), cols.map((c) => h("td", { class: "num" }, fmt(st[c], 4))),
        [lag, groups.length ? ill : null, groups.length ? fb : null].map((x) => h("td", { class: "num" }, fmt(x))),
        h("td", { title: (st.refused || []).join("\n"), class: "pre" }, refused));
    });
    return h("div", { class: "scroll short" }, h("table", { id: "steps" },
      h("tr", {}, ["step", "policy", "groups", ...cols, ...derived, "refused"].map((c) => h("th", {}, c))), rows));
  }

  // -- episodes ----------------------------------------------------------------------------

  function episodesSection() {
    const statuses = [...new Set(INDEX.groups.flatMap((g) => g.members.map((m) => m.status)))].filter(Boolean).sort();
    return h("section", { id: "episodes" }, h("h2", {}, "Steps, groups, episodes"),
      h("div", { class: "filters" },
        h("label", {}, "task ", h("input", { id: "f-task", placeholder: "task id contains" })),
        h("label", {}, "status ", h("select", { id: "f-status" }, h("option", { value: "" }, "any"), statuses.map((st) => h("option", { value: st }, st)))),
        h("label", {}, "reward ≥ ", h("input", { id: "f-rmin", type: "number", step: "any" })),
        h("label", {}, "≤ ", h("input", { id: "f-rmax", type: "number", step: "any" })),
        h("label", {}, h("input", { id: "f-fallback", type: "checkbox" }), " with a fallback"),
        h("label", {}, h("input", { id: "f-ill", type: "checkbox" }), " ill-formed"),
        h("label", {}, h("input", { id: "f-refused", type: "checkbox" }), " refused or untrained"),
        h("span", { id: "f-count", class: "muted" })),
      h("div", { class: "grid" },
        h("div", { class: "scroll", id: "browser" }, h("table", { id: "members" }), h("p", {}, h("button", { id: "more", hidden: "" }, "show more"))),
        h("div", { id: "traj", class: "muted" }, "Pick an episode on the left.")));
  }

  function filters() {
    const n = (id) => ($(id).value === "" ? null : Number($(id).value));
    return {
      task: $("f-task").value.trim(), status: $("f-status").value, rmin: n("f-rmin"), rmax: n("f-rmax"),
      fallback: $("f-fallback").checked, ill: $("f-ill").checked, refused: $("f-refused").checked,
    };
  }

  function matches(f, g, m) {
    if (f.task && !String(g.task).includes(f.task)) return false;
    if (f.status && m.status !== f.status) return false;
    if (f.rmin !== null && !(num(m.reward) && m.reward >= f.rmin)) return false;
    if (f.rmax !== null && !(num(m.reward) && m.reward <= f.rmax)) return false;
    if (f.fallback && !m.fb) return false;
    if (f.ill && !m.ill && m.stop !== "ill_formed") return false;
    if (f.refused && g.step !== null && !g.refused) return false;
    return true;
  }

  const stepOrder = (g) => (g.step === null ? Infinity : g.step);

  function statusTag(st) {
    const cls = st === "completed" ? "ok" : st === "truncated" ? "warn" : "bad";
    return h("span", { class: "tag " + cls }, st || "open");
  }

  function groupVerdict(g) {
    if (g.step === null) return h("span", { class: "tag warn" }, "not trained");
    if (g.refused) return h("span", { class: "tag bad" }, "refused: ", g.refused);
    return h("span", { class: "tag ok" }, "trained in step ", g.step);
  }

  function renderMembers() {
    const f = filters();
    const groups = INDEX.groups.slice().sort((a, b) => stepOrder(a) - stepOrder(b) || a.line - b.line);
    const rows = [h("tr", {}, ["#", "reward", "adv", "status", "stop", "turns", "marks"].map((c, i) => h("th", { class: [1, 2, 5].includes(i) ? "num" : "" }, c)))];
    let shown = 0, matched = 0, total = 0, lastStep;
    for (const g of groups) {
      const hits = g.members.filter((m) => matches(f, g, m));
      total += g.members.length;
      matched += hits.length;
      if (!hits.length || shown >= limit) continue;
      if (stepOrder(g) !== lastStep) {
        lastStep = stepOrder(g);
        rows.push(h("tr", { class: "shead" }, h("td", { colspan: 7 }, g.step === null ? "not trained (yet)" : `step ${g.step}`)));
      }
      rows.push(h("tr", { class: "ghead", "data-group": g.id }, h("td", { colspan: 7 }, "group ", h("b", {}, g.id), ` · task ${g.task} · policy v${g.v} · ${g.members.length}/${g.size} · `, groupVerdict(g))));
      for (const m of hits) {
        if (shown >= limit) break;
        shown += 1;
        const marks = [
          m.ill ? h("span", { class: "tag bad" }, `ill-formed ×${m.ill}`) : null,
          m.fb ? h("span", { class: "tag warn" }, `fallback ×${m.fb}`) : null,
          m.q ? h("span", { class: "tag bad" }, `quarantined leases ×${m.q}`) : null,
          m.error ? h("span", { class: "tag bad", title: m.error }, "error") : null,
        ].filter(Boolean).flatMap((x) => [x, " "]);
        const sel = selected && selected[0] === g.i && selected[1] === m.m ? " sel" : "";
        rows.push(h("tr", { class: "member" + sel, "data-g": g.i, "data-m": m.m, "data-task": g.task },
          h("td", {}, m.m), h("td", { class: "num" }, fmt(m.reward)), h("td", { class: "num" }, fmt(m.adv)),
          h("td", {}, statusTag(m.status)), h("td", {}, fmt(m.stop)), h("td", { class: "num" }, fmt(m.turns)), h("td", {}, marks)));
      }
    }
    replace($("members"), rows);
    const count = $("f-count");
    count.textContent = `${matched} of ${total} episodes` + (matched > shown ? ` (first ${shown} shown)` : "");
    count.dataset.matched = matched;
    count.dataset.shown = shown;
    $("more").hidden = matched <= shown;
  }

  // -- one trajectory ----------------------------------------------------------------------

  const heat = (lp) => `hsl(${Math.round(120 * Math.exp(lp))},75%,80%)`;

  function tokText(id) {
    const t = VOCAB[id];
    return typeof t === "string" ? t : `⟨${id}⟩`;
  }

  function tokens(ids, lps) {
    return (ids || []).map((id, i) => {
      const text = tokText(id);
      const special = /^<\|?[^<>\s]*\|?>$/.test(text) ? " special" : "";
      const shown = text.replace(/\n/g, "↵\n");
      if (lps) {
        const lp = lps[i];
        const p = num(lp) ? Math.exp(lp) : NaN;
        return h("span", { class: "tok c" + special, "data-id": id, "data-mask": 1, "data-lp": lp, style: `background:${num(lp) ? heat(lp) : "#f88"}`, title: `id ${id} · logprob ${lp} · p ${p.toFixed(3)}` }, shown);
      }
      return h("span", { class: "tok p" + special, "data-id": id, "data-mask": 0, title: `id ${id}` }, shown);
    });
  }

  // The env's side of each turn: the messages after the turn's assistant message.
  function replies(messages) {
    const byTurn = [];
    let k = -1;
    for (const msg of Array.isArray(messages) ? messages : []) {
      if (!msg || typeof msg !== "object") continue;
      if (msg.role === "assistant") { k += 1; byTurn[k] = []; continue; }
      if (k >= 0) byTurn[k].push(msg);
    }
    return byTurn;
  }

  const text = (x) => (typeof x === "string" ? x : JSON.stringify(x));

  async function showMember(g, m) {
    const grp = INDEX.groups[g];
    if (!grp || !grp.members[m]) return;
    selected = [g, m];
    for (const tr of document.querySelectorAll("tr.member.sel")) tr.classList.remove("sel");
    const tr = document.querySelector(`tr.member[data-g="${Number(g)}"][data-m="${Number(m)}"]`);
    if (tr) tr.classList.add("sel");
    history.replaceState(null, "", `#g=${Number(g)}&m=${Number(m)}`);
    const row = grp.members[m];
    const data = (await groupData(g)).members[m];
    if (!selected || selected[0] !== g || selected[1] !== m) return; // another was picked meanwhile
    const out = [h("h3", { id: "traj-title" }, `group ${grp.id} · member ${m} · task ${row.task}`),
      h("div", {}, statusTag(row.status), " stop: ", h("b", {}, fmt(row.stop)), " · reward ", h("b", { id: "traj-reward" }, fmt(row.reward)), " · advantage ", h("b", {}, fmt(row.adv)), " · ", groupVerdict(grp))];
    if (data.error) out.push(h("div", { class: "tag bad" }, text(data.error)));
    const info = data.info && typeof data.info === "object" ? data.info : {};
    if (info.quarantined_leases) out.push(h("h3", {}, "Quarantined leases"), jsonTable("traj-quarantined", info.quarantined_leases));
    if (info.ill_formed) out.push(h("div", { class: "env" }, "ill-formed: ", JSON.stringify(info.ill_formed)));
    if (info.env) out.push(h("div", { class: "env" }, "env: ", JSON.stringify(info.env)));
    out.push(h("div", { class: "legend muted" }, "prompt tokens ", h("span", { class: "tok p" }, "grey"), " · sampled tokens (trained on) coloured by sampler probability: ",
      [0.02, 0.2, 0.5, 0.8, 1].map((p) => h("span", { style: `background:${heat(Math.log(p))}` }, p))));
    const env = replies(data.messages);
    (data.turns || []).forEach((t, k) => {
      const marks = [t.fb ? h("span", { class: "tag warn fallback" }, "fallback: ", text(t.fb)) : null, " ", t.ill ? h("span", { class: "tag bad" }, "ill-formed") : null];
      const p = t.p || [], c = t.c || [];
      const label = t.x ? `prompt delta, ${p.length} new tokens` : `full prompt, ${p.length} tokens${k ? " (re-rendered)" : ""}`;
      const calls = ((t.msg && t.msg.tool_calls) || []).map((cl) => `${cl.function && cl.function.name}(${JSON.stringify(cl.function && cl.function.arguments)})`);
      const results = (env[k] || []).map((r) => `${text(r.role)}${r.name ? " " + text(r.name) : ""}: ${text(r.content)}`);
      out.push(h("div", { class: "turn" + (t.ill ? " ill" : ""), "data-turn": k },
        h("div", { class: "head" }, `turn ${k} · policy `, h("b", { class: "version" }, `v${t.v}`), ` · finish ${fmt(t.f)} · ${fmt(t.lat, 2)} s `, marks),
        h("div", { class: "muted" }, label), h("div", { class: "toks prompt" }, tokens(p, null)),
        h("div", { class: "muted" }, `completion, ${c.length} sampled tokens`), h("div", { class: "toks completion" }, tokens(c, t.l || [])),
        calls.length ? h("div", { class: "env calls" }, "tool calls: ", calls.join(", ")) : null,
        results.length ? h("div", { class: "env results" }, results.join("\n")) : null));
    });
    const traj = $("traj");
    traj.className = "";
    replace(traj, out);
    document.body.dataset.shown = `${g}:${m}`;
  }

  // -- wiring ------------------------------------------------------------------------------

  function fromHash() {
    const m = /g=(\d+)&m=(\d+)/.exec(location.hash);
    return m ? [Number(m[1]), Number(m[2])] : null;
  }

  function render(keep) {
    replace($("app"), header(), problems(), runSection(), episodesSection());
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
        const data = 'script[type="application/json"], script[type="application/gzip-base64"]';
        for (const old of document.querySelectorAll(data)) old.remove();
        const anchor = document.querySelector("script:not([type])");
        for (const sc of doc.querySelectorAll(data)) {
          const fresh = document.createElement("script");
          fresh.type = sc.type;
          fresh.id = sc.id;
          fresh.textContent = sc.textContent;
          document.body.insertBefore(fresh, anchor);
        }
        const keep = filterState();
        await readData();
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

  async function main() {
    try {
      await readData();
    } catch (err) {
      replace($("app"), h("div", { class: "problems", id: "problems" }, h("h2", {}, "This page's data does not read"), h("p", {}, String(err))));
      return;
    }
    render(null);
    window.plies = { ready: performance.now(), select: showMember, members: async (g) => (await groupData(g)).members.length };
    document.body.dataset.ready = "1";
    if (INDEX.live) setTimeout(() => poll(INDEX.stamp || ""), 2000);
  }

  main();
})();
