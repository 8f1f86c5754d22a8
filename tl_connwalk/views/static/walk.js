// The view of a ConnectionWalk: the walk W, the selected edge's gates, the selected query's
// incoming edges as arcs, every head's gates, and the edge contributions when given.

function renderWalk(body, data, tip) {
  const state = { batch: 0, query: null, key: null, pinned: false, scale: data.colour_scale };
  const parts = {};

  function seq() { return data.sequences[state.batch]; }
  function tokenName(i) { return "\u2018" + tokenText(seq().tokens[i]) + "\u2019 (" + i + ")"; }
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
    const scale = el("select", { "aria-label": "colour scale", class: "cwv-scale",
      on: { change: (e) => { state.scale = e.target.value; draw(); } } },
      el("option", { value: "log" }, "log"), el("option", { value: "linear" }, "linear"));
    scale.value = state.scale;
    return el("div", { class: "cwv-header" },
      el("span", { class: "cwv-title" }, "Connection walk"),
      el("span", { class: "cwv-sub" }, data.layer === null ? "" : "layer " + data.layer),
      el("span", { class: "cwv-sub" }, heads + ", " + seq().tokens.length + " positions"),
      el("label", {}, "Colour scale ", scale),
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
      box.append(el("div", {}, edgeName() + " ", el("b", { class: "mono" }, plain(s.edge[i][j]))));
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
      const sum = values.reduce((a, v) => a + v, 0);
      const total = "sum over heads " + plain(sum) + (s.edge ? ", edge " + plain(s.edge[i][j]) : "");
      box.append(el("h3", {}, data.norms ? "Norm per head \u2016A\u02b0\u1d62\u2c7c f\u02b0(x\u2c7c)\u2016"
        : "Contribution per head"),
        bars(values.map((v, h) => ["H" + h, v, max, diverging(v, max), data.norms ? plain(v) : signed(v)])),
        el("p", { class: "cwv-note" }, data.norms
          ? "Norms of each head's message: they do not add up to the edge's norm (" + total
            + "), since the heads' messages point in different directions."
          : total + "."));
    }
  }

  // what the edge numbers are: the norms of the edge's messages (the default) or as given
  function edgeName() {
    return data.norms ? "edge norm \u2016W\u1d62\u2c7c x\u2c7c T\u1d62\u2c7c\u2016" : "edge contribution";
  }

  function arcs() {
    const box = parts.arcs;
    box.textContent = "";
    const s = seq();
    const i = state.query;
    const weights = s.edge || s.walk;
    // one scale for every query: that of the whole matrix the widths come from
    const scale = colourScale(state.scale, realEdges(weights));
    const edges = [];
    for (let j = 0; j < s.tokens.length; j++) {
      if (!(s.real[i] && s.real[j]) || s.walk[i][j] <= 0) continue;
      edges.push({ key: j, query: i, value: weights[i][j], text: tokenName(j) + " \u2192 "
        + tokenName(i) + "\nW " + plain(s.walk[i][j]) + (s.edge ? "\ncontribution " + plain(s.edge[i][j]) : "") });
    }
    const what = s.edge ? edgeName() : "walk weight W\u1d62\u2c7c";
    box.append(el("h2", {}, "Edges into " + tokenName(i) + ", width \u221d " + what),
      el("p", { class: "cwv-note" }, "Arcs run from each key (sender) to the query (dot); their shade follows the "
        + scale.kind + " colour scale. Click a row of a heatmap to choose the query."),
      arcDiagram(s.tokens, edges, { width: body.clientWidth || 1100, tip, marked: i, vmax: scale.max,
        dim: s.real.map((r) => !r), colour: (e) => sequential(0.35 + 0.65 * scale.depth(e.value), 1),
        label: "edges into position " + i }));
  }

  // the entries of a [query][key] matrix on the walk's edges (what the colours are scaled to)
  function realEdges(matrix) {
    const s = seq();
    const values = [];
    matrix.forEach((row, i) => row.forEach((v, j) => {
      if (s.real[i] && s.real[j] && s.walk[i][j] > 0) values.push(v);
    }));
    return values;
  }

  function draw() {
    body.textContent = "";
    const s = seq();
    if (state.query === null) [state.query, state.key] = s.selected;
    parts.details = el("div", { class: "cwv-details" });
    parts.arcs = el("div", {});
    const wscale = colourScale(state.scale, realEdges(s.walk));
    const main = heatmap(s.walk, onEdges((v) => scaled(v, wscale)), {
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
    const gscale = colourScale(state.scale, s.gates.map(realEdges));
    s.gates.forEach((gates, h) => {
      heads.appendChild(el("figure", {}, heatmap(gates, onEdges((v) => scaled(v, gscale)), {
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
          colourBar(wscale, "walk weight W\u1d62\u2c7c"),
          el("p", { class: "cwv-note" }, "W\u1d62\u2c7c = mean over heads of A\u02b0\u1d62\u2c7c; each real row sums to 1. Hover a cell; click to pin it.")),
        el("div", { class: "cwv-col" }, el("h2", {}, "Selected edge"), parts.details)),
      parts.arcs,
      el("h2", {}, "Gates g\u02b0\u1d62\u2c7c = A\u02b0\u1d62\u2c7c / \u03a3\u2095' A\u02b0'\u1d62\u2c7c of each head"),
      heads, colourBar(gscale, "gate g\u02b0\u1d62\u2c7c"));
    if (s.edge) {
      const escale = colourScale(state.scale, realEdges(s.edge));
      const negative = s.edge.flat().some((v) => v < 0);
      const colour = negative ? (v) => scaledDiverging(v, escale) : (v) => scaled(v, escale);
      body.append(el("h2", {}, data.norms ? "Edge norms \u2016W\u1d62\u2c7c x\u2c7c T\u1d62\u2c7c\u2016 (what each edge carries)"
        : "Edge contributions"), heatmap(s.edge, onEdges(colour), {
        labels: s.tokens, size: 420, label: "edge contributions",
        onHover: (cell, ev) => {
          if (cell) tip.show(ev, tokenName(cell[1]) + " \u2192 " + tokenName(cell[0]) + "\n" + plain(s.edge[cell[0]][cell[1]]));
          else tip.hide();
          hover(cell);
        },
        onClick: (cell) => pick(cell, true),
      }), colourBar(escale, edgeName(), negative));
    }
    details();
    arcs();
  }

  draw();
}
