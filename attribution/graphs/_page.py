"""The HTML viewer of an attribution graph: one page, no external assets; ``__TITLE__`` and ``__DATA__`` filled in.

The drawing fits the window's width (from 60% to 150% of its size) and scrolls beyond that, so that every node
stays visible and can be clicked at any window width; each column is wide enough that no node covers another's
centre.
"""

from .._html import EXAMPLE_SCRIPT, EXAMPLE_STYLE

_TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body { font-family: sans-serif; margin: 0.6em 1.2em; color: #222; }
#wrap { display: flex; gap: 1em; align-items: flex-start; }
#scroll { flex: 1 1 auto; min-width: 0; overflow: auto; max-height: calc(100vh - 7em); }
svg { border: 1px solid #ddd; background: #fcfcfc; display: block; }
.node { cursor: pointer; stroke: #333; stroke-width: 0.6; }
.node.token { fill: #bbb; } .node.neuron { fill: #f2c14e; } .node.logit { fill: #7fb77e; }
.node.feature { fill: #e59866; } .node.error { fill: #fff; stroke-dasharray: 2 1; }
.node.known { stroke: #7a4b00; stroke-width: 1.2; }
.node.selected { stroke: #000; stroke-width: 2.5; }
.edge { fill: none; }
.dim .edge { opacity: 0.06; }
.edge.lit { opacity: 1 !important; }
#info { flex: 0 0 31em; position: sticky; top: 0.5em; max-height: calc(100vh - 1.5em); overflow-y: auto;
        font-family: monospace; font-size: 13px; }
#info table { border-collapse: collapse; } #info td { padding: 1px 6px; }
#unitinfo { margin-top: 0.6em; border-top: 1px solid #ddd; padding-top: 0.3em; }
#unitinfo .lists { display: flex; gap: 1.5em; }
.pos { color: #c0392b; } .neg { color: #1f77b4; }
.hint { color: #555; font-size: 13px; margin: 0.3em 0; }
text { font-size: 10px; font-family: monospace; pointer-events: none; }
text.reads { font-size: 8px; fill: #7a4b00; }
__EXAMPLE_STYLE__
</style></head>
<body>
<h3>__TITLE__</h3>
<p class="hint">Rows: layers (tokens at the bottom, logits at the top); columns: positions.
Edges: red positive, blue negative, width by |weight|. Hover or click a node for its top inputs and outputs (and, for
a neuron or feature in the given report, its top examples and logit effects); page.html#node=N opens node N.</p>
<div id="wrap"><div id="scroll"><svg id="graph" width="900" height="600"></svg></div>
<div id="info">click a node</div></div>
<script>
const G = __DATA__;
const V = G.V;
__EXAMPLE_SCRIPT__
const NS = "http://www.w3.org/2000/svg";
const svg = document.getElementById("graph"), scroller = document.getElementById("scroll");
const info = document.getElementById("info");
const T = G.tokens.length, L = G.layers;
function rowOf(n) { return n.kind === "token" ? 0 : n.kind === "logit" ? L + 1 : n.layer + 1; }
const cells = {}, crowd = new Array(T).fill(1);
G.nodes.forEach((n, i) => { const k = rowOf(n) + "_" + n.pos; (cells[k] = cells[k] || []).push(i); });
Object.values(cells).forEach(ids => { const p = G.nodes[ids[0]].pos; crowd[p] = Math.max(crowd[p], ids.length); });
const x0 = 60, colW = crowd.map(c => Math.max(70, 13 * (c + 1))), left = [x0];
colW.forEach((w, p) => left.push(left[p] + w));
const W = Math.max(600, left[T] + 20), H = Math.max(400, 26 * (L + 2) + 60), rowH = (H - 60) / (L + 2);
svg.setAttribute("viewBox", "0 0 " + W + " " + H);
function fit() {
  const scale = Math.max(0.6, Math.min(1.5, (scroller.clientWidth - 2) / W));
  svg.setAttribute("width", Math.floor(W * scale)); svg.setAttribute("height", Math.floor(H * scale));
}
fit(); window.addEventListener("resize", fit);
const xy = G.nodes.map(() => [0, 0]);
Object.values(cells).forEach(ids => ids.forEach((i, j) => {
  const n = G.nodes[i];
  xy[i] = [left[n.pos] + colW[n.pos] * (j + 1) / (ids.length + 1), H - 40 - rowH * (rowOf(n) + 0.5)];
}));
const biggest = Math.max(1e-12, ...G.edges.map(e => Math.abs(e[2])));
const edgeEls = [];
const edgeLayer = document.createElementNS(NS, "g"); svg.appendChild(edgeLayer);
G.edges.forEach((e, k) => {
  const [s, t, w] = e, line = document.createElementNS(NS, "line");
  line.setAttribute("x1", xy[s][0]); line.setAttribute("y1", xy[s][1]);
  line.setAttribute("x2", xy[t][0]); line.setAttribute("y2", xy[t][1]);
  line.setAttribute("class", "edge");
  line.setAttribute("stroke", w >= 0 ? "#c0392b" : "#1f77b4");
  line.setAttribute("stroke-width", (0.3 + 3 * Math.abs(w) / biggest).toFixed(2));
  line.setAttribute("stroke-opacity", (0.15 + 0.85 * Math.abs(w) / biggest).toFixed(2));
  line.dataset.source = s; line.dataset.target = t;
  edgeLayer.appendChild(line); edgeEls.push(line);
});
function svgText(x, y, text, cls, anchor) {
  const label = document.createElementNS(NS, "text");
  label.setAttribute("x", x); label.setAttribute("y", y); label.textContent = text;
  if (cls) label.setAttribute("class", cls);
  if (anchor) label.setAttribute("text-anchor", anchor);
  svg.appendChild(label); return label;
}
const circles = G.nodes.map((n, i) => {
  const c = document.createElementNS(NS, "circle");
  c.setAttribute("cx", xy[i][0]); c.setAttribute("cy", xy[i][1]);
  c.setAttribute("r", n.kind === "neuron" || n.kind === "feature" ? 4 : 6);
  c.setAttribute("class", "node " + n.kind + (n.unit >= 0 ? " known" : "")); c.dataset.node = i;
  const title = document.createElementNS(NS, "title"); title.textContent = n.label; c.appendChild(title);
  c.addEventListener("mouseover", () => show(i)); c.addEventListener("click", () => show(i));
  svg.appendChild(c); return c;
});
Object.values(cells).forEach(ids => {  // a unit's reading under its node, where the cell has room
  if (colW[G.nodes[ids[0]].pos] / (ids.length + 1) < 34) return;
  ids.forEach(i => { if (G.nodes[i].unit >= 0) svgText(xy[i][0], xy[i][1] + 12, G.units[G.nodes[i].unit].reads,
                                                        "reads", "middle"); });
});
G.tokens.forEach((t, p) => svgText(left[p] + colW[p] / 2, H - 10, t, "", "middle"));
for (let r = 0; r < L + 2; r++) {
  svgText(4, H - 40 - rowH * (r + 0.5) + 3, r === 0 ? "emb" : r === L + 1 ? "logit" : "L" + (r - 1));
}
function rows(list) {
  return list.map(([other, w]) => "<tr class='" + (w >= 0 ? "pos" : "neg") + "' data-node='" + other + "'><td>" +
    escape(G.nodes[other].label) + "</td><td>pos " + G.nodes[other].pos + "</td><td>" + w.toPrecision(4) +
    "</td></tr>").join("");
}
function escape(s) { const d = document.createElement("div"); d.textContent = s; return d.innerHTML; }
function unitInfo(c) {
  const box = element("div"); box.id = "unitinfo";
  box.appendChild(element("div", "", "unit " + c.label + ": density " + number(c.density) + ", max " + number(c.max)));
  box.appendChild(element("p", "hint", "top examples (shaded by activation / max; the example's token outlined)"));
  const examples = element("div"); examples.id = "examples";
  c.top.forEach(ex => examples.appendChild(exampleRow(V, ex)));
  if (!c.top.length) examples.appendChild(element("p", "hint", "none: the unit was never above its floor"));
  box.appendChild(examples);
  if (c.logits) {
    const lists = element("div", "lists"), up = element("div"), down = element("div");
    up.appendChild(element("div", "hint", "raises")); up.appendChild(logitRows(V, c.logits.top, "up"));
    down.appendChild(element("div", "hint", "lowers")); down.appendChild(logitRows(V, c.logits.bottom, "down"));
    lists.id = "logits"; lists.appendChild(up); lists.appendChild(down); box.appendChild(lists);
  }
  return box;
}
function show(i) {
  const n = G.nodes[i];
  const inputs = G.edges.filter(e => e[1] === i).map(e => [e[0], e[2]]);
  const outputs = G.edges.filter(e => e[0] === i).map(e => [e[1], e[2]]);
  const bySize = (a, b) => Math.abs(b[1]) - Math.abs(a[1]);
  inputs.sort(bySize); outputs.sort(bySize);
  svg.classList.add("dim");
  edgeEls.forEach(el => el.classList.toggle("lit", +el.dataset.source === i || +el.dataset.target === i));
  circles.forEach((c, j) => c.classList.toggle("selected", j === i));
  info.innerHTML = "<b id='selected' data-node='" + i + "'>" + escape(n.label) + "</b> (" + n.kind + ", layer " +
    n.layer + ", position " + n.pos + ", index " + n.index + ")<br>activation " + n.act + ", influence " +
    n.infl + (n.top.length ? "<br>top tokens: " + n.top.map(escape).join(" | ") : "") +
    "<p>top inputs</p><table id='inputs'>" + rows(inputs.slice(0, 10)) + "</table>" +
    "<p>top outputs</p><table id='outputs'>" + rows(outputs.slice(0, 10)) + "</table>";
  if (n.unit >= 0) info.insertBefore(unitInfo(G.units[n.unit]), info.querySelector("p"));
}
const wanted = /node=(\\d+)/.exec(location.hash);
if (wanted && circles[+wanted[1]]) circles[+wanted[1]].dispatchEvent(new MouseEvent("mouseover", {bubbles: true}));
</script>
</body></html>
"""

PAGE = _TEMPLATE.replace("__EXAMPLE_STYLE__", EXAMPLE_STYLE).replace("__EXAMPLE_SCRIPT__", EXAMPLE_SCRIPT)
"""The page, with the shared example style and script in it."""
