"""The graph file (circuit-tracer's schema), graph-metadata.json, the HTML viewer (in a browser) and the picture."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from attribution.graphs import attribution_graph
from attribution.graphs.export import node_ids
from tests.attribution.graphs.conftest import IDS


@pytest.fixture(scope="module")
def pruned(llama_graph):
    return llama_graph.prune(0.6, 0.9)


@pytest.fixture(scope="module")
def difference(llama):
    """A graph whose one logit node is the logit difference of tokens 5 and 9."""
    return attribution_graph(llama, IDS, target=[(5, 9)], progress=False, batch_size=128).prune(0.6, 0.9)


def _name(token: int) -> str:
    return f"t{token}"


def _page_nodes(page: str) -> list[dict]:
    """The node table the viewer's script reads (``const G = {...};``)."""
    return json.loads(re.search(r"^const G = (.*);$", page, re.M)[1])["nodes"]


def test_the_graph_file_follows_circuit_tracers_schema(pruned, tmp_path):
    models = pytest.importorskip("circuit_tracer.frontend.graph_models")
    content = pruned.to_json(tmp_path / "my-prompt.json", tokenizer=lambda i: f"t{i}\n")
    on_disk = json.loads((tmp_path / "my-prompt.json").read_text())
    assert on_disk == content
    model = models.Model(**on_disk)  # pydantic validation of every field
    assert model.metadata.slug == "my-prompt"
    assert model.metadata.prompt_tokens[0] == "t3⏎"  # circuit-tracer's process_token
    assert model.metadata.node_threshold == 0.6


def test_node_ids_and_links(pruned, tmp_path):
    content = pruned.to_json(tmp_path / "g.json")
    ids = node_ids(pruned)
    nodes = pruned.nodes
    for i in range(len(nodes)):
        node = nodes[i]
        expected = {"token": f"E_{node.index}_{node.position}", "logit": f"3_{node.index}_5"}.get(
            node.kind, f"{node.layer}_{node.index}_{node.position}")  # fmt: skip
        assert ids[i] == expected
    written = {n["node_id"]: n for n in content["nodes"]}
    adjacency = pruned.adjacency.coalesce()
    assert len(content["links"]) == adjacency._nnz()
    for (t, s), w, link in zip(adjacency.indices().T.tolist(), adjacency.values().tolist(), content["links"],
                               strict=True):  # fmt: skip
        assert (link["source"], link["target"], link["weight"]) == (ids[s], ids[t], w)
        assert link["source"] in written and link["target"] in written
    logits = [n for n in content["nodes"] if n["feature_type"] == "logit"]
    assert [n["is_target_logit"] for n in logits] == [True] + [False] * (len(logits) - 1)
    assert [n["token_prob"] for n in logits] == pruned.logit_weights.tolist()
    assert sum(n["feature_type"] == "embedding" for n in content["nodes"]) == 6


def test_graph_metadata_lists_each_slug_once(pruned, tmp_path):
    pruned.to_json(tmp_path / "a.json")
    pruned.to_json(tmp_path / "b.json")
    pruned.to_json(tmp_path / "a.json")
    listed = json.loads((tmp_path / "graph-metadata.json").read_text())
    assert sorted(g["slug"] for g in listed["graphs"]) == ["a", "b"]


def test_the_page_is_self_contained_and_escapes_tokens(pruned, tmp_path):
    page = pruned.to_html(tmp_path / "page.html", tokenizer=lambda i: f"<b>{i}</b>&")
    assert (tmp_path / "page.html").read_text(encoding="utf-8") == page
    assert not re.search(r"""(src|href)\s*=\s*["']?https?:""", page)
    assert "@import" not in page and "url(" not in page and "<link" not in page
    assert "<b>3" not in page and "\\u003cb\\u003e3" in page


def _browser() -> str:
    for name in ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name) or shutil.which(name, path="/usr/lib/chromium")
        if found:
            return found
    pytest.skip("no headless chromium installed (Debian: apt-get install chromium)")


@pytest.mark.slow
def test_clicking_a_node_shows_its_top_inputs_in_a_browser(pruned, tmp_path):
    path = tmp_path / "page.html"
    logit = int(pruned.nodes.where("logit")[0])
    pruned.to_html(path, top_tokens={logit: ["alpha", "beta"]})
    command = [_browser(), "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", f"file://{path}#node={logit}"]
    dom = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True).stdout
    assert dom.count('class="node ') == len(pruned.nodes)
    assert f'data-node="{logit}"' in re.search(r'<b id="selected"[^>]*>', dom)[0]
    inputs = re.search(r'<table id="inputs">(.*?)</table>', dom, re.S)[1]
    shown = [int(n) for n in re.findall(r'data-node="(\d+)"', inputs)]
    row = pruned.adjacency.to_dense()[logit]
    expected = row.abs().argsort(descending=True)[: min(10, int((row != 0).sum()))].tolist()
    assert shown == expected
    assert "alpha | beta" in dom
    outgoing = int((pruned.adjacency.to_dense()[:, logit] != 0).sum())
    assert dom.count('class="edge lit"') == int((row != 0).sum()) + outgoing


def test_the_picture_draws_every_edge_and_node(pruned):
    import matplotlib

    matplotlib.use("Agg")
    ax = pruned.plot(tokenizer=lambda i: f"t{i}")
    assert len(ax.lines) == pruned.adjacency._nnz()
    assert sum(len(c.get_offsets()) for c in ax.collections) == len(pruned.nodes)
    assert [t.get_text() for t in ax.get_xticklabels()] == [f"t{i}" for i in pruned.tokens.tolist()]
    colours = {line.get_color() for line in ax.lines}
    assert colours <= {"#c0392b", "#1f77b4"}
    key = dict(zip([t.get_text() for t in ax.get_legend().get_texts()], ax.get_legend().legend_handles, strict=True))
    assert key["positive edge"].get_color() == "#c0392b" and key["negative edge"].get_color() == "#1f77b4"
    values = pruned.adjacency.coalesce().values()
    strongest = float(values[values.abs().argmax()])  # drawn last, on top
    assert ax.lines[-1].get_color() == key["positive edge" if strongest > 0 else "negative edge"].get_color()
    import matplotlib.pyplot as plt

    plt.close(ax.figure)


def test_a_logit_difference_is_named_by_its_token_and_its_foil_in_the_file_the_page_and_the_picture(
    difference, tmp_path
):
    import matplotlib

    matplotlib.use("Agg")
    (logit,) = [n for n in difference.to_json(tmp_path / "d.json", tokenizer=_name)["nodes"]
                if n["feature_type"] == "logit"]  # fmt: skip
    assert logit["clerp"] == 'Output "t5" vs "t9" (p=1.000)'
    # circuit-tracer's viewer reads the token between the first quotes and the number after "(p=" (util-cg.js)
    assert logit["clerp"].split('"')[1] == "t5" and float(logit["clerp"].split("(p=")[1].split(")")[0]) == 1.0
    assert [n["label"] for n in _page_nodes(difference.to_html(tokenizer=_name)) if n["kind"] == "logit"] == [
        "→t5 vs t9"
    ]
    ax = difference.plot(tokenizer=_name)
    assert '"t5" vs "t9"' in [text.get_text() for text in ax.texts]
    import matplotlib.pyplot as plt

    plt.close(ax.figure)


def test_a_logit_without_a_foil_is_named_by_its_token_alone(pruned, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    tokens = pruned.nodes.index[pruned.nodes.where("logit")].tolist()
    clerps = [n["clerp"] for n in pruned.to_json(tmp_path / "p.json", tokenizer=_name)["nodes"]
              if n["feature_type"] == "logit"]  # fmt: skip
    assert clerps == [f'Output "t{t}" (p={p:.3f})' for t, p in zip(tokens, pruned.logit_weights.tolist(), strict=True)]
    labels = [n["label"] for n in _page_nodes(pruned.to_html(tokenizer=_name)) if n["kind"] == "logit"]
    assert labels == [f"→t{t}" for t in tokens]
    ax = pruned.plot(tokenizer=_name)
    assert [text.get_text() for text in ax.texts] == [f'"t{t}"' for t in tokens]
    import matplotlib.pyplot as plt

    plt.close(ax.figure)
