// The view of an Attribution: source tokens coloured by score, the selected token's components
// and routes, the layer-by-head grid and each layer's strongest edges as arcs.

function renderAttribution(body, data, tip) {
  // selected: the token shown; chosen: whether the reader picked it (else the default)
  const state = { batch: 0, selected: null, chosen: false, pinned: false, layer: null, route: null };
  // knockout_estimate: scores and edges predict what blocking would change (T - T blocked)
  const predicts = data.method === "knockout_estimate";
  const parts = {};

  function seq() { return data.sequences[state.batch]; }
  function tokenName(s) { return "\u2018" + tokenText(seq().tokens[s]) + "\u2019 (" + s + ")"; }
  // a part's share of the target T (value / T): see the note under the header
  function percent(value) {
    const total = seq().target_value;
    return data.shares && total ? (100 * value / total).toFixed(1) + "% of T" : null;
  }
  function share(value) { const p = percent(value); return p ? " (" + p + ")" : ""; }

  function header() {
    const s = seq();
    const select = batchSelect(data.sequences, (q) => q.target, (b) => {
      state.batch = b; state.selected = null; state.pinned = false; state.layer = null; draw();
    });
    if (select) select.querySelector("select").value = String(state.batch);
    const sources = s.scores.reduce((a, v) => a + v, 0);
    const rest = data.shares ? "bias (what no source sent)" : "what the method leaves unexplained";
    return el("div", {},
      el("div", { class: "cwv-header" },
        el("span", { class: "cwv-title" }, "Attribution"),
        el("span", { class: "cwv-sub" }, "method " + data.method),
        el("span", { class: "cwv-sub mono" }, "target T = " + s.target + " = " + plain(s.target_value)),
        el("span", { class: "cwv-sub" }, "T = sum of the scores " + signed(sources) + " + " + rest + " "
          + signed(s.bias)),
        select),
      el("p", { class: "cwv-note", "data-note": "shares" }, data.shares
        ? "Percentages are shares of the target: a part's value divided by T = " + plain(s.target_value)
          + ". Parts have both signs (blue raises T, red lowers it), so one part can be more than 100% of T, "
          + "or negative, when others pull the other way; the scores and the bias together make 100%."
        : predicts ? "Scores are predicted changes of T, in T's units; one per source, they need not add up to T."
        : "Scores of method " + data.method + " are in that method's own units, not a split of T: no "
          + "percentages of T are shown."),
      predicts ? el("p", { class: "cwv-note", "data-note": "knockout" }, "Each score predicts knockout: "
        + "T minus T with that token blocked from every other query in every layer, the attention "
        + "renormalised around the gap. Underlined tokens were knocked out for real (their score is "
        + "knockout's own value); a dashed box marks a token whose knockout Attribution.verify measured.")
        : null);
  }

  function tokens() {
    const s = seq();
    const max = maxAbs(s.scores);
    const row = el("div", { class: "cwv-tokens" });
    parts.chips = s.tokens.map((label, i) => el("span", {
      class: "cwv-tok" + (i === s.position ? " target" : "") + (s.exact && s.exact[i] ? " exact" : "")
        + (s.measured && s.measured[i] !== null ? " measured" : ""),
      "data-pos": String(i),
      style: { background: diverging(s.scores[i], max), color: inkOn(s.scores[i], max) },
      on: {
        mouseenter: () => { if (!state.pinned) select(i, true); },
        click: () => {
          if (state.pinned && state.selected === i) { state.pinned = false; select(s.selected, false); }
          else { state.pinned = true; select(i, true); }
        },
      },
    }, el("span", { class: "t" }, tokenText(label)), el("span", { class: "v" }, signed(s.scores[i]))));
    // the target chip wraps together with its neighbour, never onto a line of its own
    const glued = s.position > 0 ? [s.position - 1, s.position] : [s.position, s.position + 1];
    parts.chips.forEach((chip, i) => {
      if (i === glued[0] && glued[1] < parts.chips.length) {
        row.appendChild(el("span", { class: "cwv-glue" }, chip, parts.chips[glued[1]]));
      } else if (i !== glued[1]) {
        row.appendChild(chip);
      }
    });
    row.addEventListener("mouseleave", () => { if (!state.pinned) select(s.selected, false); });
    return el("div", {}, el("h2", {}, "Source tokens, coloured by score"), row,
      divergingLegend(max, "score (blue: raises the target, red: lowers it)"),
      el("p", { class: "cwv-note" }, "Shown: the token with the largest |score|. Hover a token to see where "
        + "its score goes; click to pin it, click again to go back."));
  }

  function componentBars(values, names) {
    const order = values.map((v, k) => k).filter((k) => values[k] !== 0)
      .sort((a, b) => Math.abs(values[b]) - Math.abs(values[a])).slice(0, 8);
    const max = maxAbs(order.map((k) => values[k]));
    const grid = el("div", { class: "cwv-bars" });
    for (const k of order) {
      const v = values[k];
      const width = 50 * strength(v, max);
      const fill = el("span", { class: "fill", style: {
        left: (v >= 0 ? 50 : 50 - width) + "%", width: width + "%", background: diverging(v, max) } });
      grid.append(el("span", { class: "mono" }, names[k]),
        el("span", { class: "track" }, fill, el("span", { class: "mid" })),
        el("span", { class: "mono" }, signed(v)));
    }
    return grid;
  }

  function routeLine(route) {
    const hops = [el("span", { class: "hop mono" }, tokenName(route.source))];
    for (const c of route.components) hops.push("\u2192", el("span", { class: "hop mono" }, c));
    hops.push("\u2192", el("span", { class: "hop" }, "target"));
    return el("div", { class: "cwv-route", on: {
      mouseenter: () => { state.route = route; grid(); },
      mouseleave: () => { state.route = null; grid(); },
    } }, ...hops, "  ", el("b", { class: "mono" }, signed(route.contribution)));
  }

  function details() {
    const box = parts.details;
    box.textContent = "";
    const s = seq();
    const i = state.selected;
    box.append(el("div", { class: "big" }, tokenName(i) + (i === s.position ? " \u00b7 target position" : "")),
      el("div", {}, predicts ? "predicted knockout " : "score ", el("b", { class: "mono" }, signed(s.scores[i])),
        share(s.scores[i])));
    if (s.exact && s.exact[i]) {
      box.append(el("div", { class: "cwv-note" }, "Knocked out for real: this score is knockout's own value."));
    }
    if (s.measured && s.measured[i] !== null) {
      box.append(el("div", {}, "knockout measured ", el("b", { class: "mono" }, signed(s.measured[i])),
        " (prediction error " + signed(s.scores[i] - s.measured[i]) + ")"));
    }
    if (s.components) {
      const values = s.components.map((row) => row[i]);
      box.append(el("h3", {}, "Largest direct paths into the target, from this token"),
        componentBars(values, data.components.names),
        el("p", { class: "cwv-note" }, "Each component's direct path from this token adds up, over all "
          + values.length + " components, to its score."));
    }
    box.append(el("h3", {}, "Routes from this token"));
    if (!s.routes) {
      box.append(el("p", { class: "cwv-note" }, data.notes.routes));
      return;
    }
    const mine = s.routes.filter((r) => r.source === i);
    if (mine.length) box.append(...mine.map(routeLine));
    else box.append(el("p", { class: "cwv-note" }, "None of the " + s.routes.length + " routes listed starts here."));
    if (s.routes.length > mine.length) {
      box.append(el("h3", {}, "Strongest routes, from any token"), ...s.routes.slice(0, 8).map(routeLine));
    }
  }

  function passedComponents() {
    const s = seq();
    const passed = new Set();
    const routes = state.route ? [state.route]
      : s.routes ? s.routes.filter((r) => r.source === state.selected) : [];
    for (const r of routes) for (const c of r.components) passed.add(c);
    return passed;
  }

  function grid() {
    const box = parts.grid;
    if (!box) return;
    box.textContent = "";
    const s = seq();
    const layout = data.components;
    const values = s.components.map((row) => row[state.selected]);
    const inGrid = values.filter((v, k) => layout.layer[k] >= 0);
    const max = maxAbs(inGrid);
    const passed = passedComponents();
    const cell = {};
    layout.names.forEach((name, k) => { cell[layout.layer[k] + ":" + layout.column[k]] = k; });
    const head = el("tr", {}, el("th", {}));
    for (let h = 0; h < data.n_heads; h++) head.appendChild(el("th", {}, "H" + h));
    head.append(el("td", { class: "gap" }), el("th", {}, "MLP"));
    const rows = [];
    for (let l = 0; l < data.n_layers; l++) {
      const row = el("tr", {}, el("th", {}, "L" + l));
      for (let c = 0; c <= data.n_heads; c++) {
        if (c === data.n_heads) row.appendChild(el("td", { class: "gap" }));
        const k = cell[l + ":" + c];
        if (k === undefined) { row.appendChild(el("td", {})); continue; }
        const v = values[k];
        row.appendChild(el("td", {
          class: (c === data.n_heads ? "mlp" : "") + (passed.has(layout.names[k]) ? " passed" : ""),
          "data-component": layout.names[k],
          style: { background: diverging(v, max) },
          on: {
            mousemove: (ev) => tip.show(ev, layout.names[k] + ": " + signed(v) + share(v)),
            mouseleave: () => tip.hide(),
          },
        }));
      }
      rows.push(row);
    }
    const others = layout.names.map((name, k) => k).filter((k) => layout.layer[k] < 0);
    box.append(el("h2", {}, "Each head's direct path into the target, from " + tokenName(state.selected)),
      el("table", { class: "cwv-grid" }, el("thead", {}, head), el("tbody", {}, rows)),
      divergingLegend(max, "direct path (hover a cell for its value and % of T)"),
      ...others.map((k) => el("div", { class: "cwv-note" },
        layout.names[k] + " (direct path): " + signed(values[k]) + share(values[k]))));
    if (passed.size) box.append(el("p", { class: "cwv-note" }, "Outlined: the components the routes pass."));
  }

  function flows() {
    const box = parts.flows;
    if (!box) return;
    box.textContent = "";
    const s = seq();
    const totals = s.layer_totals;
    if (state.layer === null) {
      state.layer = totals.reduce((best, v, l) => (Math.abs(v) > Math.abs(totals[best]) ? l : best), 0);
    }
    const l = state.layer;
    const vmax = maxAbs(s.edges.map((layer) => layer.map((e) => e.value)));
    const tmax = maxAbs(totals);
    const barW = Math.max(8, Math.min(30, 1000 / totals.length));
    const strip = svg("svg", { width: String(barW * totals.length + 60), height: "64",
      role: "img", "aria-label": "net edge share per layer" });
    strip.appendChild(svg("line", { x1: "0", x2: String(barW * totals.length), y1: "28", y2: "28", stroke: "#999" }));
    totals.forEach((v, k) => {
      const h = 24 * strength(v, tmax);
      const bar = svg("rect", { class: "lbar", x: String(k * barW + 1), width: String(barW - 2),
        y: String(v >= 0 ? 28 - h : 28), height: String(Math.max(h, 0.5)),
        fill: diverging(v, tmax), stroke: k === l ? "#111" : "none", "stroke-width": "1.5" });
      bar.addEventListener("click", () => { state.layer = k; flows(); });
      bar.addEventListener("mousemove", (ev) => tip.show(ev, predicts
        ? "layer " + k + ": blocking its edges one at a time changes T by " + signed(v) + share(v) + " in all (predicted)"
        : "layer " + k + ": all its edges carry " + signed(v) + share(v) + "\n(T minus T with this layer's heads silenced)"));
      bar.addEventListener("mouseleave", () => tip.hide());
      strip.appendChild(bar);
      if (totals.length <= 16 || k % 2 === 0 || k === l) {
        strip.appendChild(svg("text", { x: String(k * barW + barW / 2), y: "62", "text-anchor": "middle",
          "font-weight": k === l ? "700" : "400" }, String(k)));
      }
    });
    const move = (d) => { state.layer = Math.max(0, Math.min(totals.length - 1, l + d)); flows(); };
    const edges = s.edges[l].map((e) => {
      const heads = e.heads.map((v, h) => [h, v]).filter((p) => p[1] !== 0)
        .sort((a, b) => Math.abs(b[1]) - Math.abs(a[1])).slice(0, 4)
        .map((p) => "H" + p[0] + " " + signed(p[1])).join(", ");
      return { key: e.key, query: e.query, value: e.value, text: "layer " + l + ": "
        + tokenName(e.key) + " \u2192 " + tokenName(e.query) + "\n" + signed(e.value) + share(e.value)
        + "\nheads: " + heads };
    });
    const shown = s.edges[l].reduce((a, e) => a + e.value, 0);
    box.append(el("h2", {}, "Edge flows: the " + data.top_edges + " strongest edges of each layer"),
      el("p", { class: "cwv-note" }, predicts
        ? "Bars: the predicted effects of blocking each edge of a layer, summed (click one). Arcs: key (sender) \u2192 query (receiver, dot), width by |predicted T - T with that one edge blocked| on one scale for every layer, blue: blocking it lowers the target, red: raises it."
        : "Bars: what all the edges of a layer carry (click one). Arcs: key (sender) \u2192 query (receiver, dot), width by |share of the target| on one scale for every layer, blue raises the target and red lowers it."),
      strip,
      el("div", { class: "cwv-layers" },
        el("button", { on: { click: () => move(-1) } }, "\u25c0"),
        el("b", {}, "Layer " + l),
        el("button", { on: { click: () => move(1) } }, "\u25b6"),
        el("span", { class: "cwv-sub" }, "all edges " + signed(totals[l]) + share(totals[l])
          + "; the " + s.edges[l].length + " drawn " + signed(shown) + share(shown))),
      el("p", { class: "cwv-note" }, predicts
        ? "Each edge's value predicts T minus T with key \u2192 query blocked in the heads of layer " + l
          + ", the sum of each head's single block (listed per head, to first order). The drawn edges are the "
          + "largest by |value|, of either sign."
        : "What all the edges of layer " + l + " carry is T minus what the network "
        + "gives with that layer's heads silenced; it can exceed T (above 100%) when the rest of the network "
        + "pulls the other way. The drawn edges are the largest by |value|, of either sign."),
      arcDiagram(s.tokens, edges, { width: body.clientWidth || 1100, vmax, tip,
        marked: s.position, focus: state.chosen ? state.selected : null, label: "strongest edges of layer " + l }));
  }

  function select(i, chosen) {
    state.selected = i;
    state.chosen = chosen;
    if (parts.shown) parts.shown.textContent = tokenName(i);
    parts.chips.forEach((chip, k) => chip.classList.toggle("sel", k === i));
    details();
    grid();
    flows();
  }

  function draw() {
    body.textContent = "";
    parts.details = el("div", { class: "cwv-details" });
    const s = seq();
    parts.grid = s.components ? el("div", {}) : null;
    parts.flows = s.edges ? el("div", {}) : null;
    body.append(header(), tokens());
    parts.shown = el("span", { class: "mono" });
    body.append(el("div", { class: "cwv-cols" },
      el("div", { class: "cwv-col" }, el("h2", {}, "Selected token: ", parts.shown), parts.details),
      el("div", { class: "cwv-col fixed" }, parts.grid
        || el("p", { class: "cwv-note" }, data.notes.components))));
    body.append(parts.flows || el("p", { class: "cwv-note" }, data.notes.edges));
    select(s.selected, false);
  }

  draw();
}
