// nanovllm trace viewer: reads the trace document embedded in #trace-data and draws four
// views of it (step timeline, KV blocks over steps, requests, block tables of one step).
// Plain DOM and SVG, no libraries, no network.
"use strict";
(function () {
  const doc = JSON.parse(document.getElementById("trace-data").textContent);
  const steps = doc.steps, N = steps.length, bs = doc.block_size;
  const SVGNS = "http://www.w3.org/2000/svg";
  const reqs = doc.requests.slice();
  const rowOf = new Map(reqs.map((r, k) => [r.request_id, k]));
  const state = { i: 0, rid: null, view: "timeline" };

  // ------------------------------------------------------------------ derived data
  const preemptedBefore = new Set();   // request ids preempted at an earlier step (while scanning)
  const cellClass = steps.map((st) => {
    const m = new Map();
    for (const s of st.seqs) {
      m.set(s.request_id, s.phase === "decode" ? "decode" : preemptedBefore.has(s.request_id) ? "recompute" : "prefill");
    }
    for (const rid of st.preempted) preemptedBefore.add(rid);
    return m;
  });
  const runs = [];                     // {rid, cls, a, b}: steps a..b (indices) of one phase
  const open = new Map();
  steps.forEach((st, i) => {
    for (const [rid, cls] of cellClass[i]) {
      const r = open.get(rid);
      if (r && r.cls === cls && r.b === i - 1) { r.b = i; continue; }
      const run = { rid, cls, a: i, b: i };
      runs.push(run); open.set(rid, run);
    }
  });
  const waits = [];                    // preempted until the request runs again
  steps.forEach((st, i) => {
    for (const rid of st.preempted) {
      let j = i + 1;
      while (j < N && !cellClass[j].has(rid)) j++;
      waits.push({ rid, a: i, b: j - 1 });
    }
  });
  const preemptSteps = [], hitSteps = [];
  steps.forEach((st, i) => {
    if (st.preempted.length) preemptSteps.push(i);
    if (st.seqs.some((s) => s.num_cached_tokens > 0)) hitSteps.push(i);
  });
  const color = (rid) => `hsl(${((rowOf.get(rid) || 0) * 137.5) % 360},60%,50%)`;

  // ------------------------------------------------------------------ helpers
  function el(tag, attrs, parent, text) {
    const svg = ["svg", "rect", "line", "path", "circle", "text", "g", "title"].includes(tag);
    const e = svg ? document.createElementNS(SVGNS, tag) : document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
  const ms = (s) => (s === null || s === undefined ? "-" : (s * 1000).toFixed(1));
  function ticks(svg, x0, w, y) {        // step numbers along an axis, at least 44 px apart
    const every = Math.max(1, Math.ceil(44 / Math.max(w, 1e-6)));
    for (let i = 0; i < N; i += every) el("text", { class: "tick", x: x0 + i * w + w / 2, y, "text-anchor": "middle" }, svg, String(steps[i].step));
  }
  const clear = (e) => { while (e.firstChild) e.removeChild(e.firstChild); };
  const width = (svg) => Math.max(600, (svg.parentElement.clientWidth || 900) - 4);

  // ------------------------------------------------------------------ header
  document.getElementById("title").textContent = doc.title || "nanovllm trace";
  const c = doc.config || {};
  document.getElementById("meta").textContent = [c.model, c.device, c.dtype, bs && `block_size ${bs}`,
    c.num_kvcache_blocks && `${c.num_kvcache_blocks} KV blocks`, c.max_num_batched_tokens && `budget ${c.max_num_batched_tokens} tokens/step`,
    c.max_num_seqs && `max_num_seqs ${c.max_num_seqs}`, c.enable_prefix_caching !== undefined && `prefix caching ${c.enable_prefix_caching ? "on" : "off"}`,
    `${reqs.length} requests`, doc.created].filter(Boolean).join(" · ");
  const slider = document.getElementById("step-slider");
  slider.max = String(N - 1);
  const count = document.getElementById("step-count");
  count.textContent = `${N} steps`;
  count.dataset.count = String(N);

  // ------------------------------------------------------------------ timeline
  const tl = document.getElementById("timeline");
  const X0 = 80, TOP = 56, RH = 20;
  let cw = 10;
  const stepAt = (x) => Math.max(0, Math.min(N - 1, Math.floor((x - X0) / cw)));
  function drawTimeline() {
    clear(tl);
    const W = width(tl);
    cw = Math.max(1, Math.min(28, (W - X0 - 12) / N));
    const H = TOP + reqs.length * RH + 24;
    tl.setAttribute("width", W); tl.setAttribute("height", H);
    const selRow = state.rid === null ? -1 : rowOf.get(state.rid);
    if (selRow >= 0) el("rect", { class: "row-sel", x: 0, y: TOP + selRow * RH, width: W, height: RH }, tl);
    const maxTok = Math.max(1, ...steps.map((s) => s.num_tokens));
    steps.forEach((st, i) => {
      const h = (st.num_tokens / maxTok) * (TOP - 14);
      const b = el("rect", { class: "tok-bar", x: X0 + i * cw, y: TOP - 4 - h, width: Math.max(1, cw - 1), height: h, "data-step": i }, tl);
      el("title", {}, b, `step ${st.step}: ${st.num_tokens} tokens, ${st.seqs.length} seqs, ${ms(st.t_end - st.t_start)} ms`);
    });
    el("text", { x: 4, y: 14 }, tl, `tokens/step (max ${maxTok})`);
    reqs.forEach((r, k) => {
      const t = el("text", { x: 4, y: TOP + k * RH + 14, "data-request": r.request_id, class: "row-label" }, tl, `req ${r.request_id}`);
      t.style.fill = color(r.request_id);
    });
    for (const w of waits) {
      if (w.b < w.a) continue;
      el("rect", { class: "waiting", x: X0 + w.a * cw, y: TOP + rowOf.get(w.rid) * RH + 6, width: (w.b - w.a + 1) * cw, height: RH - 12 }, tl);
    }
    for (const r of runs) {
      const rect = el("rect", { class: `cell ${r.cls}`, x: X0 + r.a * cw, y: TOP + rowOf.get(r.rid) * RH + 2,
        width: Math.max(1, (r.b - r.a + 1) * cw - (cw > 3 ? 1 : 0)), height: RH - 4,
        "data-request": r.rid, "data-phase": r.cls, "data-first-step": r.a, "data-last-step": r.b }, tl);
      el("title", {}, rect, `${r.rid}: ${r.cls}, steps ${steps[r.a].step}-${steps[r.b].step}`);
    }
    steps.forEach((st, i) => {
      const x = X0 + i * cw + cw / 2;
      for (const rid of st.preempted) {
        const y = TOP + rowOf.get(rid) * RH;
        const p = el("path", { class: "marker preempt", d: `M${x - 5},${y} L${x + 5},${y} L${x},${y + 9} Z`, "data-step": i, "data-request": rid }, tl);
        el("title", {}, p, `step ${st.step}: ${rid} preempted`);
      }
      for (const s of st.seqs) {
        if (s.num_cached_tokens > 0) {
          const m = el("circle", { class: "marker cache-hit", cx: x, cy: TOP + rowOf.get(s.request_id) * RH + RH / 2, r: 4, "data-step": i, "data-request": s.request_id }, tl);
          el("title", {}, m, `step ${st.step}: ${s.request_id} prefix-cache hit, ${s.num_cached_tokens} tokens`);
        }
      }
      for (const [rid, reason] of st.finished) {
        const xe = X0 + (i + 1) * cw, y = TOP + rowOf.get(rid) * RH;
        const f = el("line", { class: "marker finish", x1: xe, x2: xe, y1: y + 1, y2: y + RH - 1, "data-step": i, "data-request": rid }, tl);
        el("title", {}, f, `step ${st.step}: ${rid} finished (${reason})`);
      }
    });
    ticks(tl, X0, cw, H - 8);
    el("rect", { id: "cursor", x: X0 + state.i * cw, y: 0, width: Math.max(2, cw), height: H, "pointer-events": "none" }, tl);
  }
  tl.addEventListener("click", (ev) => {
    const box = tl.getBoundingClientRect();
    const x = ev.clientX - box.left, y = ev.clientY - box.top;
    if (x < X0) { const k = Math.floor((y - TOP) / RH); if (k >= 0 && k < reqs.length) selectRequest(reqs[k].request_id, false); return; }
    const k = Math.floor((y - TOP) / RH);
    if (k >= 0 && k < reqs.length) state.rid = reqs[k].request_id;
    go(stepAt(x));
  });

  // ------------------------------------------------------------------ KV chart
  const kv = document.getElementById("kv-chart");
  const KX0 = 50, KH = 260;
  let kcw = 10;
  function drawKV() {
    clear(kv);
    const W = width(kv);
    kcw = Math.max(0.5, (W - KX0 - 12) / N);
    kv.setAttribute("width", W); kv.setAttribute("height", KH + 40);
    const total = Math.max(1, ...steps.map((s) => s.num_blocks));
    const y = (v) => 20 + (1 - v / total) * KH;
    el("line", { class: "axis", x1: KX0, x2: KX0, y1: 20, y2: 20 + KH }, kv);
    el("line", { class: "axis", x1: KX0, x2: W - 8, y1: 20 + KH, y2: 20 + KH }, kv);
    el("text", { x: 4, y: 24 }, kv, String(total));
    el("text", { x: 4, y: 20 + KH }, kv, "0");
    ticks(kv, KX0, kcw, KH + 34);
    let d = `M${KX0},${y(0)}`;
    steps.forEach((st, i) => {
      const used = st.num_blocks - st.num_free_blocks;
      d += ` L${KX0 + i * kcw},${y(used)} L${KX0 + (i + 1) * kcw},${y(used)}`;
    });
    d += ` L${KX0 + N * kcw},${y(0)} Z`;
    el("path", { class: "kv-area", d }, kv);
    steps.forEach((st, i) => {
      const used = st.num_blocks - st.num_free_blocks;
      const p = el("rect", { class: "kv-point", x: KX0 + i * kcw, y: y(used), width: Math.max(0.5, kcw), height: 2, "data-step": i, "data-used": used, fill: "#3b82c4" }, kv);
      el("title", {}, p, `step ${st.step}: ${used}/${st.num_blocks} blocks in use`);
    });
    for (const i of preemptSteps) {
      const x = KX0 + (i + 0.5) * kcw;
      const m = el("path", { class: "marker preempt", d: `M${x - 5},${8} L${x + 5},${8} L${x},${17} Z`, "data-step": i }, kv);
      el("title", {}, m, `step ${steps[i].step}: preempted ${steps[i].preempted.join(", ")}`);
    }
    for (const i of hitSteps) {
      const st = steps[i];
      const m = el("circle", { class: "marker cache-hit", cx: KX0 + (i + 0.5) * kcw, cy: y(st.num_blocks - st.num_free_blocks) - 6, r: 4, "data-step": i }, kv);
      el("title", {}, m, `step ${st.step}: prefix-cache hit`);
    }
    el("rect", { class: "kv-cursor", x: KX0 + state.i * kcw, y: 20, width: Math.max(2, kcw), height: KH, "pointer-events": "none" }, kv);
  }
  kv.addEventListener("click", (ev) => {
    const x = ev.clientX - kv.getBoundingClientRect().left;
    go(Math.max(0, Math.min(N - 1, Math.floor((x - KX0) / kcw))));
  });

  // ------------------------------------------------------------------ requests
  const COLS = [["request_id", "request"], ["num_prompt_tokens", "prompt"], ["num_output_tokens", "output"],
    ["first_step", "first step"], ["first_token_step", "first token step"], ["finish_step", "finish step"],
    ["finish_reason", "reason"], ["num_prefill_chunks", "prefill chunks"], ["num_preemptions", "preemptions"],
    ["num_recompute_steps", "recompute steps"], ["num_cached_tokens", "cache-hit tokens"], ["t_first_token", "first token (ms)"], ["t_finish", "finished (ms)"], ["text", "text"]];
  const stepNo = (i) => (i === null || i === undefined ? "-" : String(i));
  function drawRequests() {
    const table = document.getElementById("requests");
    const head = table.tHead, body = table.tBodies[0];
    clear(head); clear(body);
    const hr = el("tr", {}, head);
    for (const [, name] of COLS) el("th", {}, hr, name);
    for (const r of reqs) {
      const tr = el("tr", { "data-request": r.request_id }, body);
      if (r.request_id === state.rid) tr.classList.add("selected");
      for (const [key] of COLS) {
        let v = r[key];
        if (key.startsWith("t_")) v = ms(v);
        else if (key.endsWith("_step")) v = stepNo(v);
        const td = el("td", { "data-key": key, class: key === "text" ? "text" : "" }, tr, v === null || v === undefined ? "-" : String(v));
        if (key === "request_id") td.style.color = color(r.request_id);
        if (key === "text" && v) td.title = v;
      }
      tr.addEventListener("click", () => selectRequest(r.request_id, true));
    }
  }

  // ------------------------------------------------------------------ one step
  function drawStep() {
    const box = document.getElementById("step-detail");
    clear(box);
    const st = steps[state.i];
    el("h2", {}, box, `step ${st.step} (${state.i + 1} of ${N}): ${st.kind}, ${st.num_tokens} tokens, ${st.seqs.length} sequences, ` +
      `${ms(st.t_end - st.t_start)} ms, ${st.num_blocks - st.num_free_blocks}/${st.num_blocks} blocks in use after it`);
    const lists = el("div", { class: "step-lists" }, box);
    if (st.preempted.length) el("div", { class: "preempted" }, lists, `preempted to make room: ${st.preempted.join(", ")}`);
    if (st.finished.length) el("div", { class: "finished" }, lists, `finished: ${st.finished.map(([r, why]) => `${r} (${why})`).join(", ")}`);
    el("div", { class: "legend" }, box, "Block tables: one cell per KV block (its id; below it, the tokens it holds after this step). " +
      "Blue: written by this step. Green: prefix-cache hit at admission.");
    for (const s of st.seqs) {
      const div = el("div", { class: "seq", "data-request": s.request_id }, box);
      const head = el("div", { class: "seq-head" }, div);
      const rid = el("span", { class: "rid" }, head, s.request_id);
      rid.style.color = color(s.request_id);
      const end = s.num_computed_before + s.num_new_tokens;
      head.appendChild(document.createTextNode(`  ${cellClass[state.i].get(s.request_id)}  tokens [${s.num_computed_before}:${end}) of ${s.num_tokens}` +
        (s.num_cached_tokens > 0 ? `  prefix-cache hit ${s.num_cached_tokens} tokens` : "") + (end === s.num_tokens ? "  samples a token" : "")));
      const table = el("table", { class: "block-table", "data-request": s.request_id }, div);
      const tr = el("tr", {}, table);
      const hits = s.num_cached_tokens > 0 && bs ? Math.floor(s.num_cached_tokens / bs) : 0;
      const w0 = bs ? Math.floor(s.num_computed_before / bs) : -1, w1 = bs ? Math.floor((end - 1) / bs) : -2;
      s.block_ids.forEach((b, j) => {
        const td = el("td", { "data-block-id": b, "data-index": j }, tr, String(b));
        if (j < hits) td.classList.add("hit");
        if (s.num_new_tokens > 0 && j >= w0 && j <= w1) td.classList.add("write");
        if (bs) el("span", { class: "fill" }, td, `${Math.max(0, Math.min(bs, end - j * bs))}/${bs}`);
      });
    }
    if (st.num_blocks <= 4096) {
      const owner = new Map();
      for (const s of st.seqs) for (const b of s.block_ids) owner.set(b, s.request_id);
      const used = st.num_blocks - st.num_free_blocks;
      el("div", { class: "legend" }, box, `The whole KV cache (${st.num_blocks} blocks): colored by the request of this step that holds them; ` +
        `${Math.max(0, used - owner.size)} more in use by running requests not scheduled in this step.`);
      const map = el("div", { id: "block-map" }, box);
      for (let b = 0; b < st.num_blocks; b++) {
        const cell = el("span", { "data-block": b, title: owner.has(b) ? `block ${b}: ${owner.get(b)}` : `block ${b}` }, map);
        if (owner.has(b)) cell.style.background = color(owner.get(b));
      }
    }
  }

  // ------------------------------------------------------------------ state changes
  function renderStepbar() {
    const st = steps[state.i];
    slider.value = String(state.i);
    document.getElementById("step-label").textContent = `step ${st.step} (${state.i + 1}/${N})`;
    document.getElementById("step-label").dataset.index = String(state.i);
    document.getElementById("step-summary").textContent =
      `${st.kind}: ${st.num_tokens} tokens, ${st.seqs.length} seqs [${st.seqs.map((s) => `${s.request_id}:${s.phase[0]}${s.num_new_tokens}`).join(" ")}]` +
      ` · ${st.num_free_blocks}/${st.num_blocks} blocks free · ${ms(st.t_end - st.t_start)} ms` +
      (st.preempted.length ? ` · preempted ${st.preempted.join(", ")}` : "") +
      (st.finished.length ? ` · finished ${st.finished.map((f) => f[0]).join(", ")}` : "") +
      (state.rid !== null ? ` · selected request ${state.rid}` : "");
  }
  function render() {
    renderStepbar();
    document.querySelectorAll("#tabs button").forEach((b) => b.setAttribute("aria-selected", String(b.dataset.view === state.view)));
    document.querySelectorAll(".view").forEach((v) => v.classList.toggle("active", v.id === `view-${state.view}`));
    if (state.view === "timeline") drawTimeline();
    else if (state.view === "kv") drawKV();
    else if (state.view === "requests") drawRequests();
    else drawStep();
  }
  function go(i) { state.i = Math.max(0, Math.min(N - 1, i)); render(); }
  function setView(v) { state.view = v; render(); }
  function selectRequest(rid, jump) {
    state.rid = rid;
    const r = reqs[rowOf.get(rid)];
    if (jump && r && r.first_step !== null) {
      const k = steps.findIndex((s) => s.step === r.first_step);
      if (k >= 0) state.i = k;
    }
    render();
  }
  function jumpTo(list, dir) {
    const next = dir > 0 ? list.find((i) => i > state.i) : [...list].reverse().find((i) => i < state.i);
    if (next !== undefined) go(next);
  }
  document.querySelectorAll("#tabs button").forEach((b) => b.addEventListener("click", () => setView(b.dataset.view)));
  document.getElementById("first").addEventListener("click", () => go(0));
  document.getElementById("prev").addEventListener("click", () => go(state.i - 1));
  document.getElementById("next").addEventListener("click", () => go(state.i + 1));
  document.getElementById("last").addEventListener("click", () => go(N - 1));
  slider.addEventListener("input", () => go(Number(slider.value)));
  document.addEventListener("keydown", (ev) => {
    const views = { 1: "timeline", 2: "kv", 3: "requests", 4: "step" };
    const k = ev.key;
    if (views[k]) setView(views[k]);
    else if (k === "ArrowRight") go(state.i + (ev.shiftKey ? 10 : 1));
    else if (k === "ArrowLeft") go(state.i - (ev.shiftKey ? 10 : 1));
    else if (k === "PageDown") go(state.i + 10);
    else if (k === "PageUp") go(state.i - 10);
    else if (k === "Home") go(0);
    else if (k === "End") go(N - 1);
    else if (k === "ArrowDown" || k === "ArrowUp") {
      const cur = state.rid === null ? -1 : rowOf.get(state.rid);
      const nxt = Math.max(0, Math.min(reqs.length - 1, cur + (k === "ArrowDown" ? 1 : -1)));
      selectRequest(reqs[nxt].request_id, state.view === "requests");
    } else if (k === "p") jumpTo(preemptSteps, 1);
    else if (k === "P") jumpTo(preemptSteps, -1);
    else if (k === "c") jumpTo(hitSteps, 1);
    else if (k === "C") jumpTo(hitSteps, -1);
    else return;
    ev.preventDefault();
  });
  window.addEventListener("resize", render);
  window.traceViewer = { state, go, setView, selectRequest, doc };
  render();
})();
