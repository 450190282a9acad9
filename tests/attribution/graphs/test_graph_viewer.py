"""The graph viewer with a feature report: nodes read as text, a clicked unit shows its examples and logit effects.

The graph has neurons at layer 0 and features at layer 1 (a TopK SAE on the MLP's output); the report reads the
same SAE's features and the even neurons of layer 0, so that some unit nodes have a unit in the report and some not.
"""

from __future__ import annotations

import re

import pytest
import torch

from attribution._html import visible
from attribution.features import Features, Neurons, feature_statistics
from attribution.graphs import attribution_graph
from tests.attribution.graphs.conftest import IDS
from tests.attribution.graphs.test_graph_basis import _dictionary
from tests.browser import launched, page_data

TEXT = {3: "<b>x</b>", 4: "a & b", 7: "  two\n", 9: "</script>"}
SHOT = "/tmp/hookscope-graph.png"


def text(i: int) -> str:
    return TEXT.get(i, f" w{i}")


@pytest.fixture(scope="module")
def setting(llama):
    """``(graph, pruned graph, report)``."""
    sae = _dictionary("sae-topk")
    graph = attribution_graph(llama, IDS, basis={"model.layers.1.mlp": sae}, progress=False, batch_size=128)
    documents = torch.randint(3, 40, (24, 16), generator=torch.Generator().manual_seed(2))
    units = [Features(sae, "model.layers.1.mlp"), Neurons(0, indices=range(0, 24, 2))]
    report = feature_statistics(llama, documents, units, k=6, bands=2, samples=2, tokenizer=text, progress=False)
    return graph, graph.prune(0.99, 0.995), report


def _unit(report, graph, i: int) -> int | None:
    kind, layer, index = graph.nodes.kind[i], int(graph.nodes.layer[i]), int(graph.nodes.index[i])
    return report.find(kind, layer, index) if kind in ("neuron", "feature") else None


def test_nodes_with_a_unit_read_as_text_and_carry_its_examples_and_logits(setting, tmp_path):
    _, pruned, report = setting
    page = pruned.to_html(tmp_path / "graph.html", tokenizer=text, features=report)
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page) and "<link" not in page
    assert page.count("</script>") == 1 and "<b>x" not in page
    data = page_data(page, "G")
    shown = {int(i): t for i, t in data["V"].items()}
    assert shown == {i: visible(text(i)) for i in shown}
    kinds = {"feature": [0, 0], "neuron": [0, 0]}
    for i, node in enumerate(data["nodes"]):
        unit = _unit(report, pruned, i)
        if node["kind"] in kinds:
            kinds[node["kind"]][unit is None] += 1
        if unit is None:
            assert node["unit"] == -1 and not node["label"].startswith("“")
            continue
        card = data["units"][node["unit"]]
        top = report.top(unit)
        assert card["label"] == report.labels[unit] and card["unit"] == unit
        assert [(e["d"], e["p"], e["t"]) for e in card["top"]] == [(e.document, e.position, list(e.tokens))
                                                                  for e in top[:5]]  # fmt: skip
        assert card["reads"] == visible(text(top[0].tokens[top[0].offset]))
        assert node["label"].startswith(f"“{card['reads']}” L")
        assert [t for t, _ in card["logits"]["top"]] == [t for t, _ in report.logit_effects(unit, 6)[0]]
        assert card["density"] == pytest.approx(float(report.density[unit]), rel=1e-3)
    assert kinds["feature"][0] > 0 and kinds["neuron"][0] > 0 and kinds["neuron"][1] > 0  # each case is here
    assert len({n["unit"] for n in data["nodes"] if n["unit"] >= 0}) == len(data["units"])  # one card per unit
    with pytest.raises(TypeError, match="`features` must be a UnitReport"):
        pruned.to_html(features={"L0/F1": []})


# -- in a browser ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    with launched() as launched_browser:
        yield launched_browser


SHOWN = """() => {
  const info = document.getElementById("info");
  const at = Array.from(info.querySelectorAll("#examples .ex")).map(ex => ex.querySelector(".tok.at").textContent);
  return {selected: Number(document.getElementById("selected").dataset.node), examples: at,
          logits: info.querySelectorAll("#logits tr").length, text: info.textContent};
}"""


@pytest.mark.slow
def test_a_click_on_any_node_shows_its_info_and_examples_in_a_browser(setting, browser, tmp_path):
    _, pruned, report = setting
    path = tmp_path / "graph.html"
    pruned.to_html(path, tokenizer=text, features=report)
    data = page_data(path.read_text(encoding="utf-8"), "G")
    page = browser.page(path.as_uri())
    circles = page.locator("circle.node")
    assert circles.count() == len(pruned.nodes)
    for i in range(len(pruned.nodes)):
        circles.nth(i).click(timeout=5000)  # fails where another element would take the click
        shown = page.evaluate(SHOWN)
        assert shown["selected"] == i and data["nodes"][i]["label"] in shown["text"]
        unit = _unit(report, pruned, i)
        if unit is None:
            assert shown["examples"] == [] and shown["logits"] == 0
            continue
        top = report.top(unit)[:5]
        assert shown["examples"] == [visible(text(e.tokens[e.offset])) for e in top]
        assert shown["logits"] == 12 and f"unit {report.labels[unit]}: density" in shown["text"]
    circles.nth(int(pruned.nodes.where("feature")[0])).click()
    page.screenshot(path=SHOT)
    assert browser.errors == []


@pytest.mark.slow
def test_every_node_of_a_wide_graph_is_visible_and_clickable_at_1280x800(setting, browser, tmp_path):
    """Issue 40: the viewer clipped its last columns (the logits) at 1280 px, and #wrap took the logit's click."""
    graph, _, report = setting
    path = tmp_path / "wide.html"
    graph.to_html(path, tokenizer=text, features=report)
    page = browser.page(path.as_uri())
    hidden = page.evaluate("""() => Array.from(document.querySelectorAll("circle.node")).filter(c => {
      c.scrollIntoView({block: "center", inline: "center"});
      const box = c.getBoundingClientRect(), x = box.x + box.width / 2, y = box.y + box.height / 2;
      const inside = x >= 0 && y >= 0 && x < innerWidth && y < innerHeight;
      return !inside || document.elementFromPoint(x, y) !== c;
    }).map(c => Number(c.dataset.node))""")
    assert len(graph.nodes) > 150 and hidden == []
    for i in graph.nodes.where("logit").tolist():
        page.locator(f'circle.node[data-node="{i}"]').click(timeout=5000)
        assert page.evaluate(SHOWN)["selected"] == i
    assert browser.errors == []
