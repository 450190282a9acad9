"""What offloading costs the LM methods: SmolLM2-135M plain against the same model with its layers on disk.

Each configuration runs in a fresh process (its peak resident memory, ``VmHWM``, is its own): the model is saved once as
safetensors, then loaded plainly or with ``device_map="auto"`` and a CPU budget that sends the layers to disk, and
one method runs on the IOI prompt. Prints the load time, the method's time and the process's peak RSS.

    python -m benchmarks.offload_memory
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

METHODS = ("logit_lens", "direct_logit_attribution", "edge_attribution", "AttnLRP")


def _child(folder: str, method: str, offload: bool) -> dict:
    import torch
    import transformers

    import attribution as A

    start = time.perf_counter()
    kwargs = (
        {"device_map": "auto", "max_memory": {"cpu": "30MiB"}, "offload_folder": f"{folder}/off"} if offload else {}
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, **kwargs).eval()
    loaded = time.perf_counter() - start
    clean, corrupted, metric = _prompts(folder)
    start = time.perf_counter()
    with torch.no_grad() if method == "logit_lens" else torch.enable_grad():
        if method == "logit_lens":
            A.logit_lens(model, clean)
        elif method == "direct_logit_attribution":
            A.direct_logit_attribution(model, clean, (int(clean[0, 2]), int(clean[0, 4])))
        elif method == "edge_attribution":
            A.edge_attribution(model, clean, corrupted, metric, progress=False)
        else:
            A.AttnLRP(model)(clean, target=int(clean[0, 2]))
    took = time.perf_counter() - start
    return {"load_s": loaded, "method_s": took, "peak_rss_mb": _peak_rss_mb()}


def _peak_rss_mb() -> float:
    """This process's peak resident memory (``VmHWM``: unlike ``ru_maxrss`` it is not inherited across exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _prompts(folder: str):
    import torch

    ids = json.loads(Path(folder, "prompts.json").read_text())
    clean, corrupted = torch.tensor([ids["clean"]]), torch.tensor([ids["corrupted"]])
    a, b = ids["answers"]
    return clean, corrupted, lambda out: out.logits[:, -1, a].mean() - out.logits[:, -1, b].mean()


def _prepare(folder: str) -> None:
    from examples._smollm2 import ioi_prompts, load_smollm2

    model, tokenizer = load_smollm2()
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # dequantised on load: saved as plain float32 weights
    plain = type(model)(config)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(folder)
    data = ioi_prompts(tokenizer)
    prompts = {"clean": data.clean[0].tolist(), "corrupted": data.corrupted[0].tolist(),
               "answers": [int(data.io[0]), int(data.s[0])]}  # fmt: skip
    Path(folder, "prompts.json").write_text(json.dumps(prompts))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", nargs=3, metavar=("FOLDER", "METHOD", "OFFLOAD"))
    parser.add_argument("--prepare", metavar="FOLDER")
    args = parser.parse_args()
    if args.prepare:
        _prepare(args.prepare)
        return
    if args.child:
        folder, method, offload = args.child
        print(json.dumps(_child(folder, method, offload == "1")))
        return
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run([sys.executable, "-m", "benchmarks.offload_memory", "--prepare", folder], check=True)
        print("| method | plain: s | plain: peak RSS MB | disk offload: s | disk offload: peak RSS MB |")
        print("|---|---|---|---|---|")
        for method in METHODS:
            row = []
            for offload in ("0", "1"):
                out = subprocess.run([sys.executable, "-m", "benchmarks.offload_memory", "--child", folder, method,
                                      offload], capture_output=True, text=True, check=True)  # fmt: skip
                result = json.loads(out.stdout.strip().splitlines()[-1])
                row += [f"{result['method_s']:.2f}", f"{result['peak_rss_mb']:.0f}"]
            print(f"| {method} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
