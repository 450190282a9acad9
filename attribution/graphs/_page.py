"""The HTML viewer of an attribution graph: one page, no external assets; ``__TITLE__`` and ``__DATA__`` filled in."""

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body { font-family: sans-serif; margin: 1em 2em; color: #222; }
#wrap { display: flex; gap: 1.5em; align-items: flex-start; }
svg { border: 1px solid #ddd; background: #fcfcfc; }
.node { cursor: pointer; stroke: #333; stroke-width: 0.6; }
.node.token { fill: #bbb; } .node.neuron { fill: #f2c14e; } .node.logit { fill: #7fb77e; }
.node.feature { fill: #e59866; } .node.error { fill: #fff; stroke-dasharray: 2 1; }
.node.selected { stroke: #000; stroke-width: 2.5; }
.edge { fill: none; }
.dim .edge { opacity: 0.06; }
.edge.lit { opacity: 1 !important; }
#info { font-family: monospace; font-size: 13px; min-width: 26em; max-width: 34em; }
#info table { border-collapse: collapse; } #info td { padding: 1px 6px; }
.pos { color: #c0392b; } .neg { color: #1f77b4; }
.hint { color: #555; font-size: 13px; }
text { font-size: 10px; font-family: monospace; }
</style></head>
<body>
<h3>__TITLE__</h3>
<p class="hint">Rows: layers (tokens at the bottom, logits at the top); columns: positions.
Edges: red positive, blue negative, width by |weight|. Hover or click a node for its top inputs and outputs;
page.html#node=N opens node N.</p>
<div id="wrap"><svg id="graph" width="900" height="600"></svg><div id="info">click a node</div></div>
<script>
const G = __DATA__;
const NS = "http://www.w3.org/2000/svg";
const svg = document.getElementById("graph");
const info = document.getElementById("info");
const T = G.tokens.length, L = G.layers;
const W = Math.max(600, 70 * T + 80), H = Math.max(400, 26 * (L + 2) + 60);
svg.setAttribute("width", W); svg.setAttribute("height", H);
const x0 = 60, colW = (W - x0 - 20) / T, rowH = (H - 60) / (L + 2);
function rowOf(n) { return n.kind === "token" ? 0 : n.kind === "logit" ? L + 1 : n.layer + 1; }
const cells = {};
G.nodes.forEach((n, i) => { const k = rowOf(n) + "_" + n.pos; (cells[k] = cells[k] || []).push(i); });
const xy = G.nodes.map(() => [0, 0]);
Object.values(cells).forEach(ids => ids.forEach((i, j) => {
  const n = G.nodes[i];
  xy[i] = [x0 + colW * (n.pos + (j + 1) / (ids.length + 1)), H - 40 - rowH * (rowOf(n) + 0.5)];
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
const circles = G.nodes.map((n, i) => {
  const c = document.createElementNS(NS, "circle");
  c.setAttribute("cx", xy[i][0]); c.setAttribute("cy", xy[i][1]);
  c.setAttribute("r", n.kind === "neuron" || n.kind === "feature" ? 4 : 6);
  c.setAttribute("class", "node " + n.kind); c.dataset.node = i;
  const title = document.createElementNS(NS, "title"); title.textContent = n.label; c.appendChild(title);
  c.addEventListener("mouseover", () => show(i)); c.addEventListener("click", () => show(i));
  svg.appendChild(c); return c;
});
G.tokens.forEach((t, p) => {
  const label = document.createElementNS(NS, "text");
  label.setAttribute("x", x0 + colW * (p + 0.5)); label.setAttribute("y", H - 10);
  label.setAttribute("text-anchor", "middle"); label.textContent = t; svg.appendChild(label);
});
for (let r = 0; r < L + 2; r++) {
  const label = document.createElementNS(NS, "text");
  label.setAttribute("x", 4); label.setAttribute("y", H - 40 - rowH * (r + 0.5) + 3);
  label.textContent = r === 0 ? "emb" : r === L + 1 ? "logit" : "L" + (r - 1); svg.appendChild(label);
}
function rows(list) {
  return list.map(([other, w]) => "<tr class='" + (w >= 0 ? "pos" : "neg") + "' data-node='" + other + "'><td>" +
    escape(G.nodes[other].label) + "</td><td>pos " + G.nodes[other].pos + "</td><td>" + w.toPrecision(4) +
    "</td></tr>").join("");
}
function escape(s) { const d = document.createElement("div"); d.textContent = s; return d.innerHTML; }
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
}
const wanted = /node=(\\d+)/.exec(location.hash);
if (wanted && circles[+wanted[1]]) circles[+wanted[1]].dispatchEvent(new MouseEvent("mouseover", {bubbles: true}));
</script>
</body></html>
"""
