"use strict";
// Helpers shared by the views. Every string from the data reaches the page through
// textContent or an attribute value, never as markup.

const SVG_NS = "http://www.w3.org/2000/svg"; // an XML namespace name, not a resource
const POSITIVE = [33, 102, 172];
const NEGATIVE = [178, 24, 43];
const SEQUENTIAL = [63, 0, 125];
const CHAR_WIDTH = 6.7; // pixels per character of an 11 px monospace label

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (name === "on") {
      for (const [event, handler] of Object.entries(value)) node.addEventListener(event, handler);
    } else if (name === "style") {
      Object.assign(node.style, value);
    } else {
      node.setAttribute(name, value);
    }
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.appendChild(typeof child === "string" ? document.createTextNode(child) : child);
  }
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, value);
  if (text !== undefined) node.textContent = text;
  return node;
}

function plain(value) {
  if (value === null || value === undefined || !isFinite(value)) return "n/a";
  const tiny = value !== 0 && Math.abs(value) < 1e-3;
  return Math.abs(value) >= 1e4 || tiny ? value.toExponential(2) : value.toPrecision(3);
}

function signed(value) {
  if (value === null || value === undefined || !isFinite(value)) return "n/a";
  return (value < 0 ? "\u2212" : "+") + plain(Math.abs(value));
}

function mix(colour, t) {
  return "rgb(" + colour.map((c) => Math.round(255 + (c - 255) * t)).join(",") + ")";
}

function strength(value, max) {
  if (value === null || !isFinite(value) || !(max > 0)) return 0;
  return Math.min(1, Math.abs(value) / max);
}

// blue for positive, red for negative, white at zero; |value| / max sets the depth
function diverging(value, max) {
  if (value === null || !isFinite(value)) return "#e8e8e8";
  return mix(value >= 0 ? POSITIVE : NEGATIVE, strength(value, max));
}

// white at zero to dark purple at max (for values that are never negative)
function sequential(value, max) {
  if (value === null || !isFinite(value)) return "#e8e8e8";
  return mix(SEQUENTIAL, strength(value, max));
}

// How |value| maps to a colour's depth t in [0, 1]: "linear" (|v| / max) or "log"
// (log|v| from `floor` to `max`, floor the smallest |v| shown, at most DECADES decades
// below max; anything above 0 gets at least the depth MIN_DEPTH, so it stays visible).
const DECADES = 4;
const MIN_DEPTH = 0.06;
function colourScale(kind, values) {
  const max = maxAbs(values);
  let floor = max;
  for (const v of values.flat(Infinity)) {
    if (v !== null && isFinite(v) && v !== 0) floor = Math.min(floor, Math.abs(v));
  }
  const clipped = floor < max * Math.pow(10, -DECADES);
  floor = Math.max(floor, max * Math.pow(10, -DECADES));
  const span = Math.log10(max) - Math.log10(floor);
  function depth(value) {
    if (value === null || !isFinite(value) || !(max > 0) || value === 0) return 0;
    const a = Math.min(Math.abs(value), max);
    if (kind !== "log") return a / max;
    if (!(span > 0)) return 1;
    const t = (Math.log10(Math.max(a, floor)) - Math.log10(floor)) / span;
    return MIN_DEPTH + (1 - MIN_DEPTH) * t;
  }
  return { kind, max, floor, clipped, depth };
}

// the sequential colour of `value` on `scale` (padding and no-edge colours are the caller's)
function scaled(value, scale) {
  if (value === null || !isFinite(value)) return "#e8e8e8";
  return mix(SEQUENTIAL, scale.depth(value));
}

// blue or red by sign, depth by |value| on `scale`
function scaledDiverging(value, scale) {
  if (value === null || !isFinite(value)) return "#e8e8e8";
  return mix(value >= 0 ? POSITIVE : NEGATIVE, scale.depth(value));
}

// 10 to the power k, with a superscript exponent
function decade(k) {
  if (k === 0) return "1";
  if (k === 1) return "10";
  const sup = { "-": "\u207b", 0: "\u2070", 1: "\u00b9", 2: "\u00b2", 3: "\u00b3", 4: "\u2074",
    5: "\u2075", 6: "\u2076", 7: "\u2077", 8: "\u2078", 9: "\u2079" };
  return "10" + String(k).split("").map((c) => sup[c]).join("");
}

// The ticks of a colour bar, [{value, at}] with `at` in [0, 1] along the bar: both ends, and
// on a log scale the powers of ten between them that are not too close to another tick.
function scaleTicks(scale) {
  if (!(scale.max > 0)) return [{ value: 0, at: 0 }];
  if (scale.kind !== "log") {
    return [{ value: 0, at: 0 }, { value: scale.max / 2, at: 0.5 }, { value: scale.max, at: 1 }];
  }
  const ticks = [{ value: scale.floor, at: scale.depth(scale.floor) },
    { value: scale.max, at: 1 }];
  const low = Math.ceil(Math.log10(scale.floor));
  for (let k = low; Math.pow(10, k) < scale.max; k++) {
    const at = scale.depth(Math.pow(10, k));
    if (ticks.every((t) => Math.abs(t.at - at) > 0.14)) ticks.push({ value: Math.pow(10, k), at, k });
  }
  return ticks.sort((a, b) => a.at - b.at);
}

// A colour bar for `scale`: the gradient, its ticks, and what it shows with the scale's name.
// `diverges`: a diverging bar (red for negative values, blue for positive, |value| on the scale).
function colourBar(scale, what, diverges) {
  const depthAt = (t) => (scale.kind === "log" ? MIN_DEPTH + (1 - MIN_DEPTH) * t : t);
  const steps = [];
  for (let k = 0; k <= 10; k++) steps.push(mix(SEQUENTIAL, depthAt(k / 10)) + " " + 10 * k + "%");
  const bar = el("span", { class: "bar" });
  let ticks;
  if (diverges) {
    const half = [];
    for (let k = 10; k >= 0; k--) half.push(mix(NEGATIVE, depthAt(k / 10)) + " " + 5 * (10 - k) + "%");
    for (let k = 0; k <= 10; k++) half.push(mix(POSITIVE, depthAt(k / 10)) + " " + (50 + 5 * k) + "%");
    bar.style.background = "linear-gradient(to right, " + half.join(", ") + ")";
    ticks = [{ text: "\u2212" + plain(scale.max), at: 0 }, { text: "0", at: 0.5 },
      { text: "+" + plain(scale.max), at: 1 }];
  } else {
    bar.style.background = "linear-gradient(to right, " + steps.join(", ") + ")";
    ticks = scaleTicks(scale).map((t) => ({ at: t.at,
      text: t.k !== undefined ? decade(t.k) : plain(t.value) }));
  }
  const marks = el("span", { class: "ticks" }, ticks.map((t) => el("span", {
    class: "tick" + (t.at <= 0.02 ? " first" : t.at >= 0.98 ? " last" : ""),
    style: { left: 100 * t.at + "%" } }, t.text)));
  const name = scale.kind === "log"
    ? "log scale" + (scale.max > 0 ? ", " + plain(scale.floor) + " to " + plain(scale.max)
      + (scale.clipped ? "; smaller values at the lightest shade" : "") : "")
    : "linear scale";
  return el("div", { class: "cwv-cbar", "data-scale": scale.kind },
    el("span", { class: "scale" }, bar, marks),
    el("span", { class: "what" }, what + " (" + name + ")"));
}

function inkOn(value, max) {
  return strength(value, max) > 0.55 ? "#fff" : "#222";
}

function maxAbs(values) {
  let max = 0;
  for (const v of values.flat(Infinity)) if (v !== null && isFinite(v)) max = Math.max(max, Math.abs(v));
  return max;
}

// a token as it reads on the page: line breaks and tabs made visible
function tokenText(label) {
  return label.replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5").replace(/\r/g, "\u240d") || "\u2205";
}

function legend(left, right, colours) {
  const bar = el("span", { class: "bar" });
  bar.style.background = "linear-gradient(to right, " + colours.join(", ") + ")";
  return el("div", { class: "cwv-legend" }, el("span", {}, left), bar, el("span", {}, right));
}

function divergingLegend(max, what) {
  return legend(signed(-max), signed(max) + "  " + what,
    [diverging(-max, max), diverging(0, max), diverging(max, max)]);
}

function makeTip(root) {
  const tip = el("div", { class: "cwv-tip" });
  root.appendChild(tip);
  return {
    show(event, text) {
      tip.textContent = text;
      tip.style.display = "block";
      const x = Math.min(event.clientX + 14, window.innerWidth - tip.offsetWidth - 8);
      const y = Math.min(event.clientY + 14, window.innerHeight - tip.offsetHeight - 8);
      tip.style.left = Math.max(0, x) + "px";
      tip.style.top = Math.max(0, y) + "px";
    },
    hide() { tip.style.display = "none"; },
  };
}

function batchSelect(sequences, label, onChange) {
  if (sequences.length < 2) return null;
  const select = el("select", { "aria-label": "sequence", on: { change: (e) => onChange(+e.target.value) } },
    sequences.map((seq, b) => el("option", { value: String(b) }, "sequence " + b + ": " + label(seq))));
  return el("label", {}, "Sequence ", select);
}

// Which of n positions, `step` pixels apart, get a label on a rotated axis: neighbours'
// labels must be LABEL_GAP pixels apart across the text, so every k-th position is labelled
// (`first` positions, such as the marked one, before the others).
const LABEL_GAP = 13;
const LABEL_ANGLE = 55;
function labelledPositions(n, step, first) {
  const across = step * Math.sin((LABEL_ANGLE * Math.PI) / 180);
  const every = Math.max(1, Math.ceil(LABEL_GAP / across));
  const shown = [];
  const order = first.filter((i) => i !== null && i !== undefined && i >= 0 && i < n);
  for (let i = 0; i < n; i += 1) order.push(i);
  for (const i of order) {
    if (shown.every((k) => Math.abs(k - i) >= every)) shown.push(i);
  }
  return { every, shown: new Set(shown) };
}

// Arcs from each edge's key (sender) to its query (receiver) over a row of tokens.
// edges: [{key, query, value, text}]; width by |value| / vmax (or opts.depth(value), in
// [0, 1]); colour by sign unless `colour`. Labels never overlap: horizontal when every label
// fits its slot, else rotated, and on a dense axis only every k-th (hover the axis for all).
function arcDiagram(labels, edges, opts) {
  const n = labels.length;
  const width = opts.width || 1100;
  const texts = labels.map((label) => {
    const text = tokenText(label);
    return text.length > 14 ? text.slice(0, 13) + "\u2026" : text;
  });
  const maxLabel = texts.reduce((m, t) => Math.max(m, t.length), 1);
  const fits = (step) => maxLabel * CHAR_WIDTH + 6 <= step;
  const slot = (left) => Math.max(4, Math.min(64, (width - 2 * left) / Math.max(n, 1)));
  const rotate = !fits(slot(16));
  // rotated labels reach left of their position: room for the first one's
  const reach = (texts[0] || "").length * CHAR_WIDTH * Math.cos((LABEL_ANGLE * Math.PI) / 180);
  const left = rotate ? Math.max(16, Math.ceil(reach + 4)) : 16;
  const step = slot(left);
  const x = (i) => left + step * (i + 0.5);
  const span = edges.reduce((m, e) => Math.max(m, Math.abs(e.query - e.key)), 1);
  const lift = Math.min(170, Math.max(40, (span * step) / 2 + 16));
  const { every, shown } = rotate ? labelledPositions(n, step, [opts.marked, opts.focus])
    : { every: 1, shown: new Set(labels.map((_, i) => i)) };
  const labelHeight = rotate ? Math.min(110, CHAR_WIDTH * maxLabel * 0.82 + 14) : 18;
  const base = lift + 8;
  const node = svg("svg", { width: String(left * 2 + step * n), height: String(base + labelHeight + 6),
    role: "img", "aria-label": opts.label || "edge flows" });
  node.appendChild(svg("line", { x1: String(left), x2: String(left + step * n), y1: String(base),
    y2: String(base), stroke: "#bbb" }));
  texts.forEach((short, i) => {
    if (!shown.has(i)) {
      node.appendChild(svg("line", { x1: String(x(i)), x2: String(x(i)), y1: String(base),
        y2: String(base + 3), stroke: "#bbb" }));
      return;
    }
    const attrs = { class: "tokl", x: String(x(i)), y: String(base + 13) };
    if (rotate) {
      Object.assign(attrs, { "text-anchor": "end",
        transform: "rotate(-" + LABEL_ANGLE + " " + x(i) + " " + (base + 13) + ")" });
    } else {
      attrs["text-anchor"] = "middle";
    }
    const t = svg("text", attrs, short);
    if (opts.marked === i) t.setAttribute("font-weight", "700");
    if (opts.dim && opts.dim[i]) t.setAttribute("fill", "#bbb");
    node.appendChild(t);
  });
  if (opts.tip) { // every position's label on hover, the unlabelled ones included
    labels.forEach((label, i) => {
      const slot = svg("rect", { class: "slot", x: String(x(i) - step / 2), y: String(base + 2),
        width: String(step), height: String(labelHeight), fill: "transparent" });
      slot.addEventListener("mousemove", (ev) => opts.tip.show(ev, "\u2018" + tokenText(label) + "\u2019 (" + i + ")"));
      slot.addEventListener("mouseleave", () => opts.tip.hide());
      node.appendChild(slot);
    });
  }
  if (opts.marked !== undefined && opts.marked !== null) {
    node.appendChild(svg("circle", { cx: String(x(opts.marked)), cy: String(base), r: "4",
      fill: "#111" }));
  }
  const vmax = opts.vmax > 0 ? opts.vmax : maxAbs(edges.map((e) => e.value));
  const ordered = edges.slice().sort((a, b) => Math.abs(a.value) - Math.abs(b.value));
  for (const e of ordered) {
    const w = 1 + 11 * (opts.depth ? opts.depth(e.value) : strength(e.value, vmax));
    const colour = opts.colour ? opts.colour(e) : mix(e.value >= 0 ? POSITIVE : NEGATIVE, 0.85);
    let d;
    if (e.key === e.query) { // an edge from a position to itself: a ring above it
      const r = 5 + w / 2;
      const cy = base - r - w / 2;
      d = "M " + x(e.key) + " " + (cy + r) + " a " + r + " " + r + " 0 1 1 0.01 0";
    } else {
      const a = Math.min(x(e.key), x(e.query));
      const b = Math.max(x(e.key), x(e.query));
      const ry = Math.min(lift - 6, (b - a) / 2);
      d = "M " + a + " " + base + " A " + (b - a) / 2 + " " + ry + " 0 0 1 " + b + " " + base;
    }
    const highlighted = opts.focus === undefined || opts.focus === null
      || e.key === opts.focus || e.query === opts.focus;
    const path = svg("path", { class: "arc", d, stroke: colour, "stroke-width": w.toFixed(2),
      "stroke-opacity": highlighted ? "0.8" : "0.15" });
    if (opts.tip) {
      path.addEventListener("mousemove", (ev) => opts.tip.show(ev, e.text));
      path.addEventListener("mouseleave", () => opts.tip.hide());
    }
    node.appendChild(path);
    node.appendChild(svg("circle", { cx: String(x(e.query)), cy: String(base - 1), r: "2.5",
      fill: colour, "fill-opacity": highlighted ? "1" : "0.2" }));
  }
  const note = every > 1 ? el("p", { class: "cwv-note" }, "Every " + ordinal(every)
    + " token labelled on this axis (they would overlap); hover the axis for each token.") : null;
  return el("div", { class: "cwv-arcs", "data-label-every": String(every) }, node, note);
}

function ordinal(k) {
  return k === 2 ? "second" : k === 3 ? "third" : k + "th";
}

// A matrix drawn on a canvas, one cell per entry; hover and click report [row, column].
function heatmap(matrix, colour, opts) {
  const rows = matrix.length;
  const cols = rows ? matrix[0].length : 0;
  const cell = opts.cell || Math.max(2, Math.min(22, Math.floor((opts.size || 360) / Math.max(cols, 1))));
  const margin = opts.labels && cell >= 8 ? 90 : 0;
  const canvas = el("canvas", { role: "img", "aria-label": opts.label || "heatmap" });
  const ratio = window.devicePixelRatio || 1;
  const w = margin + cols * cell;
  const h = margin + rows * cell;
  canvas.width = Math.ceil(w * ratio);
  canvas.height = Math.ceil(h * ratio);
  canvas.style.width = w + "px";
  canvas.style.height = h + "px";
  const ctx = canvas.getContext("2d");
  ctx.scale(ratio, ratio);
  for (let i = 0; i < rows; i++) {
    for (let j = 0; j < cols; j++) {
      ctx.fillStyle = colour(matrix[i][j], i, j);
      ctx.fillRect(margin + j * cell, margin + i * cell, cell - (cell > 6 ? 1 : 0),
        cell - (cell > 6 ? 1 : 0));
    }
  }
  if (margin) {
    ctx.fillStyle = "#333";
    ctx.font = Math.min(11, cell - 1) + "px ui-monospace, Menlo, Consolas, monospace";
    ctx.textBaseline = "middle";
    ctx.textAlign = "right";
    opts.labels.forEach((label, i) => {
      const t = tokenText(label);
      ctx.fillText(t.length > 12 ? t.slice(0, 11) + "\u2026" : t, margin - 4, margin + (i + 0.5) * cell);
    });
    opts.labels.forEach((label, j) => {
      const t = tokenText(label);
      ctx.save();
      ctx.translate(margin + (j + 0.5) * cell, margin - 4);
      ctx.rotate(-Math.PI / 3);
      ctx.textAlign = "left";
      ctx.fillText(t.length > 12 ? t.slice(0, 11) + "\u2026" : t, 0, 0);
      ctx.restore();
    });
  }
  const at = (ev) => {
    const box = canvas.getBoundingClientRect();
    const j = Math.floor((ev.clientX - box.left - margin) / cell);
    const i = Math.floor((ev.clientY - box.top - margin) / cell);
    return i >= 0 && j >= 0 && i < rows && j < cols ? [i, j] : null;
  };
  if (opts.onHover) {
    canvas.addEventListener("mousemove", (ev) => opts.onHover(at(ev), ev));
    canvas.addEventListener("mouseleave", (ev) => opts.onHover(null, ev));
  }
  if (opts.onClick) canvas.addEventListener("click", (ev) => { const p = at(ev); if (p) opts.onClick(p, ev); });
  return canvas;
}

// Parse the page's JSON, draw the view, and leave data-state="ok" (or the error) on the root.
function run(root, render) {
  try {
    const data = JSON.parse(root.querySelector("script.cwv-data").textContent);
    render(root.querySelector(".cwv-body"), data, makeTip(root));
    root.setAttribute("data-state", "ok");
  } catch (error) {
    root.setAttribute("data-state", "error");
    root.appendChild(el("p", { class: "cwv-error" }, "This view failed to draw: " + String(error)));
    throw error;
  }
}
