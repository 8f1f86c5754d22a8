// The view of a ConnectionWalk: the walk W, the selected edge's gates, the selected query's
// incoming edges as arcs, every head's gates, and the edge contributions when given.

function renderWalk(body, data, tip) {
  const state = { batch: 0, query: null, key: null, pinned: false };
  const parts = {};

  function seq() { return data.sequences[state.batch]; }
  function tokenName(i) { return "\u2018" + tokenText(seq().tokens[i]) + "\u2019 (" + i + ")"; }
  function lastReal() { const r = seq().real; let i = r.length - 1; while (i > 0 && !r[i]) i--; return i; }
  function maxOf(matrix) { return maxAbs(matrix); }
  // padding grey, pairs that are no edge (W = 0) near white
  function onEdges(colour) {
    return (v, i, j) => {
      const s = seq();
      if (!(s.real[i] && s.real[j])) return "#d9d9d9";
      return s.walk[i][j] > 0 ? colour(v) : "#f6f6f6";
    };
  }

  function header() {
    const heads = data.n_heads + " heads"
      + (data.value_heads ? ", " + new Set(data.value_heads).size + " value heads" : "");
    const select = batchSelect(data.sequences, (s) => s.tokens.length + " positions", (b) => {
      state.batch = b; state.pinned = false; state.query = null; state.key = null; draw();
    });
    if (select) select.querySelector("select").value = String(state.batch);
    return el("div", { class: "cwv-header" },
      el("span", { class: "cwv-title" }, "Connection walk"),
      el("span", { class: "cwv-sub" }, data.layer === null ? "" : "layer " + data.layer),
      el("span", { class: "cwv-sub" }, heads + ", " + seq().tokens.length + " positions"),
      select);
  }

  function pick(cell, pin) {
    if (!cell) return;
    if (pin) {
      const same = state.pinned && state.query === cell[0] && state.key === cell[1];
      state.pinned = !same;
    }
    state.query = cell[0];
    state.key = cell[1];
    details();
    arcs();
  }

  function hover(cell) { if (!state.pinned && cell) pick(cell, false); }

  function bars(rows) {
    const grid = el("div", { class: "cwv-bars" });
    for (const [name, value, max, colour, text] of rows) {
      const fill = el("span", { class: "fill", style: {
        left: "0", width: 100 * strength(value, max) + "%", background: colour } });
      grid.append(el("span", { class: "mono" }, name), el("span", { class: "track" }, fill),
        el("span", { class: "mono" }, text));
    }
    return grid;
  }

  function details() {
    const box = parts.details;
    box.textContent = "";
    const s = seq();
    const i = state.query;
    const j = state.key;
    box.append(el("div", { class: "big" }, tokenName(j) + " \u2192 " + tokenName(i)),
      el("div", {}, "walk W", el("sub", {}, "ij"), " = ", el("b", { class: "mono" }, plain(s.walk[i][j]))));
    if (s.edge) {
      box.append(el("div", {}, "edge contribution ", el("b", { class: "mono" }, plain(s.edge[i][j]))));
    }
    if (!(s.real[i] && s.real[j])) box.append(el("p", { class: "cwv-note" }, "Padding: no edge."));
    const rows = [];
    const H = data.n_heads;
    for (let h = 0; h < H; h++) {
      const g = s.gates[h][i][j];
      rows.push(["H" + h + " gate", g, 1, sequential(0.75, 1), plain(g)]);
    }
    box.append(el("h3", {}, "Gates g\u02b0 (they sum to 1 over the heads)"), bars(rows));
    const pattern = [];
    for (let h = 0; h < H; h++) {
      const a = H * s.walk[i][j] * s.gates[h][i][j];
      pattern.push(["H" + h + " A", a, 1, sequential(0.45, 1), plain(a)]);
    }
    box.append(el("h3", {}, "Attention A\u02b0 = H W g\u02b0"), bars(pattern));
    if (s.head) {
      const values = [];
      for (let h = 0; h < H; h++) values.push(s.head[h][i][j]);
      const max = maxAbs(values);
      box.append(el("h3", {}, "Contribution per head"),
        bars(values.map((v, h) => ["H" + h, v, max, diverging(v, max), signed(v)])));
    }
  }

  function arcs() {
    const box = parts.arcs;
    box.textContent = "";
    const s = seq();
    const i = state.query;
    const weights = s.edge || s.walk;
    // one scale for every query: W is at most 1, a contribution at most the largest one
    const vmax = s.edge ? maxAbs(s.edge) : 1;
    const edges = [];
    for (let j = 0; j < s.tokens.length; j++) {
      if (!(s.real[i] && s.real[j]) || s.walk[i][j] <= 0) continue;
      edges.push({ key: j, query: i, value: weights[i][j], text: tokenName(j) + " \u2192 "
        + tokenName(i) + "\nW " + plain(s.walk[i][j]) + (s.edge ? "\ncontribution " + plain(s.edge[i][j]) : "") });
    }
    const what = s.edge ? "edge contribution" : "walk weight W\u1d62\u2c7c";
    box.append(el("h2", {}, "Edges into " + tokenName(i) + ", width by " + what),
      el("p", { class: "cwv-note" }, "Click a row of a heatmap to choose the query; arcs run from each key (sender) to the query (dot)."),
      arcDiagram(s.tokens, edges, { width: body.clientWidth || 1100, tip, marked: i, vmax,
        dim: s.real.map((r) => !r), colour: (e) => sequential(0.35 + 0.65 * strength(e.value, vmax), 1),
        label: "edges into position " + i }));
  }

  function draw() {
    body.textContent = "";
    const s = seq();
    if (state.query === null) {
      state.query = lastReal();
      const row = s.walk[state.query];
      state.key = row.reduce((best, v, j) => (v > row[best] ? j : best), 0);
    }
    parts.details = el("div", { class: "cwv-details" });
    parts.arcs = el("div", {});
    const wmax = maxOf(s.walk);
    const main = heatmap(s.walk, onEdges((v) => sequential(v, wmax)), {
      labels: s.tokens, size: 420, label: "walk W",
      onHover: (cell, ev) => {
        if (cell) tip.show(ev, tokenName(cell[1]) + " \u2192 " + tokenName(cell[0]) + "\nW " + plain(s.walk[cell[0]][cell[1]]));
        else tip.hide();
        hover(cell);
      },
      onClick: (cell) => pick(cell, true),
    });
    const heads = el("div", { class: "cwv-heads" });
    const perRow = Math.min(data.n_heads, 6);
    const small = Math.max(60, Math.min(160, Math.floor((1100 - 10 * perRow) / perRow)));
    const gmax = maxAbs(s.gates.map((g) => g.map((row, i) => row.filter((v, j) => s.walk[i][j] > 0))));
    s.gates.forEach((gates, h) => {
      heads.appendChild(el("figure", {}, heatmap(gates, onEdges((v) => sequential(v, gmax)), {
        size: small, label: "gates of head " + h,
        onHover: (cell, ev) => {
          if (cell) tip.show(ev, "H" + h + "  " + tokenName(cell[1]) + " \u2192 " + tokenName(cell[0]) + "\ngate " + plain(gates[cell[0]][cell[1]]));
          else tip.hide();
          hover(cell);
        },
        onClick: (cell) => pick(cell, true),
      }), el("figcaption", {}, "H" + h + (data.value_heads ? " (value head " + data.value_heads[h] + ")" : ""))));
    });
    body.append(header(),
      el("div", { class: "cwv-cols" },
        el("div", { class: "cwv-col fixed" }, el("h2", {}, "Walk W (rows: query i, columns: key j)"), main,
          legend("0", plain(wmax), [sequential(0, 1), sequential(1, 1)]),
          el("p", { class: "cwv-note" }, "W\u1d62\u2c7c = mean over heads of A\u02b0\u1d62\u2c7c; each real row sums to 1. Hover a cell; click to pin it.")),
        el("div", { class: "cwv-col" }, el("h2", {}, "Selected edge"), parts.details)),
      parts.arcs,
      el("h2", {}, "Gates g\u02b0\u1d62\u2c7c = A\u02b0\u1d62\u2c7c / \u03a3\u2095' A\u02b0'\u1d62\u2c7c of each head"),
      heads, legend("0", plain(gmax), [sequential(0, 1), sequential(1, 1)]));
    if (s.edge) {
      const emax = maxOf(s.edge);
      const negative = s.edge.flat().some((v) => v < 0);
      const colour = negative ? (v) => diverging(v, emax) : (v) => sequential(v, emax);
      body.append(el("h2", {}, "Edge contributions"), heatmap(s.edge, onEdges(colour), {
        labels: s.tokens, size: 420, label: "edge contributions",
        onHover: (cell, ev) => {
          if (cell) tip.show(ev, tokenName(cell[1]) + " \u2192 " + tokenName(cell[0]) + "\n" + plain(s.edge[cell[0]][cell[1]]));
          else tip.hide();
          hover(cell);
        },
        onClick: (cell) => pick(cell, true),
      }), negative ? divergingLegend(emax, "") : legend("0", plain(emax), [sequential(0, 1), sequential(1, 1)]));
    }
    details();
    arcs();
  }

  draw();
}
