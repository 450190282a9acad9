"""The dashboard's page: one file, no external assets; ``__TITLE__``, ``__NOTE__`` and ``__DATA__`` filled in."""

from .._html import EXAMPLE_SCRIPT, EXAMPLE_STYLE

_TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body { margin: 0; font-family: sans-serif; color: #222; font-size: 14px; }
#side { position: fixed; top: 0; left: 0; bottom: 0; width: 230px; box-sizing: border-box; padding: 10px;
        border-right: 1px solid #ddd; background: #f7f7f7; display: flex; flex-direction: column; }
#search { width: 100%; box-sizing: border-box; padding: 4px; font-size: 14px; }
#count { color: #555; font-size: 12px; margin: 4px 0; }
#units { list-style: none; margin: 0; padding: 0; overflow-y: auto; flex: 1; font-family: monospace; }
#units li { padding: 2px 4px; cursor: pointer; border-radius: 3px; }
#units li:hover { background: #e8e8e8; } #units li.selected { background: #333; color: #fff; }
#units li.dead { color: #999; } #units li.selected.dead { color: #ddd; }
#page { margin-left: 230px; padding: 8px 18px; }
h1 { font-size: 17px; margin: 4px 0; } h2 { font-size: 18px; margin: 8px 0 4px; font-family: monospace; }
h3 { font-size: 14px; margin: 12px 0 4px; }
.hint { color: #555; font-size: 12px; margin: 2px 0; } .note { color: #8a4b00; font-size: 13px; }
#columns { display: flex; gap: 24px; align-items: flex-start; }
#left { flex: 0 0 370px; } #right { flex: 1 1 auto; min-width: 0; }
#stats td { padding: 0 8px 0 0; font-family: monospace; font-size: 13px; }
table.logits td { padding: 0 6px; font-size: 13px; }
.lists { display: flex; gap: 16px; }
.hist text { font-size: 10px; font-family: monospace; fill: #444; }
.band { margin-top: 6px; } .band .range { font-family: monospace; font-size: 12px; color: #555; }
#bandkind label { margin-right: 12px; font-size: 13px; }
a { color: #1f5f94; }
__EXAMPLE_STYLE__
.ex { display: flex; align-items: baseline; } .ex .head { flex: none; min-width: 14.5em; }
.ex .ctx { flex: 1 1 0; min-width: 0; }
</style></head>
<body>
<nav id="side">
<input id="search" type="search" placeholder="search labels or example text" aria-label="search units">
<div id="count"></div>
<ul id="units"></ul>
</nav>
<main id="page">
<h1>__TITLE__</h1>
<p class="note">__NOTE__</p>
<p class="hint">Tokens are shaded by the unit's activation as a share of its max (red above 0, blue below); the
example's own token is outlined; whitespace is drawn visibly (· space, ⏎ newline, → tab). page.html#unit=LABEL opens
a unit.</p>
<div id="unit"></div>
</main>
<script>
const D = __DATA__;
const V = D.V;
__EXAMPLE_SCRIPT__
const list = document.getElementById("units"), search = document.getElementById("search");
const view = document.getElementById("unit");
const byLabel = new Map(D.units.map((u, i) => [u.label, i]));
let bandKind = "interval";
D.units.forEach((u, i) => {
  const li = element("li", u.dead ? "dead" : "", u.label);
  li.dataset.unit = i;
  li.title = "density " + number(u.density) + ", max " + number(u.max);
  li.addEventListener("click", () => { location.hash = "unit=" + encodeURIComponent(u.label); });
  list.appendChild(li);
});
function filter() {
  const q = search.value.trim().toLowerCase();
  let shown = 0;
  Array.from(list.children).forEach((li, i) => {
    const u = D.units[i], ok = !q || u.label.toLowerCase().includes(q) || u.text.includes(q);
    li.hidden = !ok; shown += ok ? 1 : 0;
  });
  document.getElementById("count").textContent = shown + " of " + D.units.length + " units";
}
search.addEventListener("input", filter);
function section(title, id) {
  const s = element("section"); s.id = id; s.appendChild(element("h3", "", title)); return s;
}
function statsTable(u) {
  const s = section("Statistics", "stats"), table = element("table");
  Object.entries(u.stats).forEach(([name, value]) => {
    const tr = element("tr"); tr.appendChild(element("td", "", name));
    tr.appendChild(element("td", "", name === "count" ? String(value) : number(value))); table.appendChild(tr);
  });
  s.appendChild(table); return s;
}
function histogram(u) {
  const s = section("Histogram of non-zero values", "hist");
  const holder = element("div"); holder.innerHTML = u.hist;  // built from numbers only, in Python
  s.appendChild(holder); return s;
}
function logits(u) {
  const s = section("Logit effects", "logits");
  if (!u.logits) { s.appendChild(element("p", "hint", "none in this report")); return s; }
  const both = element("div", "lists");
  const up = element("div"); up.appendChild(element("div", "hint", "raises"));
  up.appendChild(logitRows(V, u.logits.top, "up"));
  const down = element("div"); down.appendChild(element("div", "hint", "lowers"));
  down.appendChild(logitRows(V, u.logits.bottom, "down"));
  both.appendChild(up); both.appendChild(down); s.appendChild(both); return s;
}
function neighbours(u) {
  const s = section("Neighbours", "neighbours");
  if (!u.neighbours) { s.appendChild(element("p", "hint", "none in this report")); return s; }
  s.appendChild(element("div", "hint", "by " + u.neighbours.by));
  const table = element("table");
  u.neighbours.list.forEach(([label, value]) => {
    const tr = element("tr"), td = element("td");
    if (byLabel.has(label)) {
      const a = element("a", "", label); a.href = "#unit=" + encodeURIComponent(label); td.appendChild(a);
    } else td.textContent = label;
    tr.appendChild(td); tr.appendChild(element("td", "", number(value))); table.appendChild(tr);
  });
  s.appendChild(table); return s;
}
function examples(title, id, list, empty) {
  const s = section(title, id);
  if (!list.length) s.appendChild(element("p", "hint", empty));
  list.forEach(ex => s.appendChild(exampleRow(V, ex)));
  return s;
}
function bandSamples(u) {
  const s = element("div"); s.id = "bandlist";
  const b = u.bands[bandKind];
  for (let j = b.samples.length - 1; j >= 0; j--) {
    const band = element("div", "band");
    band.appendChild(element("div", "range", "band " + (j + 1) + ": (" + number(b.edges[j]) + ", " +
      number(b.edges[j + 1]) + "]" + (b.samples[j].length ? "" : "  no samples")));
    b.samples[j].forEach(ex => band.appendChild(exampleRow(V, ex)));
    s.appendChild(band);
  }
  return s;
}
function bands(u) {
  const s = section("Band samples", "bands");
  if (!u.bands) { s.appendChild(element("p", "hint", "none in this report (bands=0)")); return s; }
  const switcher = element("div"); switcher.id = "bandkind";
  [["interval", "equal-width intervals of (0, max]"], ["rank", "equal-count rank bins"]].forEach(([kind, text]) => {
    const label = element("label"), input = element("input");
    input.type = "radio"; input.name = "bandkind"; input.value = kind; input.checked = kind === bandKind;
    input.addEventListener("change", () => { bandKind = kind; s.replaceChild(bandSamples(u), s.lastChild); });
    label.appendChild(input); label.appendChild(document.createTextNode(" " + text)); switcher.appendChild(label);
  });
  s.appendChild(switcher); s.appendChild(bandSamples(u)); return s;
}
function show(i) {
  const u = D.units[i];
  Array.from(list.children).forEach((li, j) => li.classList.toggle("selected", j === i));
  const head = element("h2", "", u.label + (u.dead ? " (dead)" : "")); head.id = "label"; head.dataset.unit = i;
  const left = element("div"), right = element("div"), columns = element("div");
  left.id = "left"; right.id = "right"; columns.id = "columns";
  [statsTable(u), histogram(u), logits(u), neighbours(u)].forEach(e => left.appendChild(e));
  right.appendChild(examples("Top examples", "top", u.top, "none: the unit was never read"));
  right.appendChild(bands(u));
  right.appendChild(examples("Non-activating samples", "quiet", u.quiet, "none: the unit is never at most 0"));
  columns.appendChild(left); columns.appendChild(right);
  view.replaceChildren(head, columns);
}
function fromHash() {
  const m = /unit=([^&]*)/.exec(location.hash);
  const wanted = m ? decodeURIComponent(m[1]) : null;
  const i = wanted === null ? undefined : byLabel.get(wanted);
  if (D.units.length) show(i === undefined ? 0 : i);
  if (wanted !== null && i === undefined) view.prepend(element("p", "note", "no unit " + wanted + " on this page"));
}
window.addEventListener("hashchange", fromHash);
filter();
fromHash();
</script>
</body></html>
"""

PAGE = _TEMPLATE.replace("__EXAMPLE_STYLE__", EXAMPLE_STYLE).replace("__EXAMPLE_SCRIPT__", EXAMPLE_SCRIPT)
"""The page, with the shared example style and script in it."""
