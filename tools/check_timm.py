"""timm vision models across families compiled whole by tpu_inductor and by Inductor, against
eager torch: inference output, and a training step's loss and every gradient.

timm is not a dependency of the project: it imports torchvision, and PyPI's torchvision does not
load beside the CPU torch 2.13.0 that CI uses ("operator torchvision::nms does not exist"). It
runs in a venv of its own, outside the repository, with torch 2.14.1 (the project supports
torch >= 2.11; on x86_64 pip takes these two from the machine's disk):

    python3.11 -m venv /tmp/timmenv
    /tmp/timmenv/bin/pip install torch==2.14.1 torchvision==0.29.1
    /tmp/timmenv/bin/pip install timm jax==0.10.2 jaxlib==0.10.2 numpy flatbuffers platformdirs \\
        safetensors pytest
    /tmp/timmenv/bin/pip install -e . --no-deps
    nice -n 19 /tmp/timmenv/bin/python tools/check_timm.py [--archs resnet18,vit_tiny] \\
        [--backends tpu_inductor,inductor] [--json F]

Per architecture (ARCHS): `timm.create_model(name, pretrained=False, num_classes=10, ...)` at a
small width or depth where the family allows one, random seeded weights (nothing is
downloaded), a batch of 2 images of 64 x 64. Each backend compiles a deep copy with
`fullgraph=True` (tpu_inductor with fallback="error", so an op without a rule fails), in eval
mode for inference and in train mode (batch norm's batch statistics) for the step; the loss is
the cross entropy on fixed labels. Equal means torch.testing.assert_close at the model tests'
rtol = atol = 1e-4 for the output, the loss and every parameter's gradient, or (`unequal`) a
distance from a float64 run no more than twice eager float32's. Prints one JSON line per
(architecture, backend) as it finishes, then the table.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import traceback

SIZE = 64
TOL = {"rtol": 1e-4, "atol": 1e-4}

# name -> (family, timm model name, create_model's keyword arguments)
ARCHS = {
    "resnet18": ("ResNet", "resnet18", {}),
    "resnext26ts": ("ResNet", "resnext26ts", {}),
    "efficientnet_b0": ("EfficientNet", "efficientnet_b0", {}),
    "efficientnet_lite0": ("EfficientNet", "efficientnet_lite0", {}),
    "mobilenetv2_050": ("MobileNet", "mobilenetv2_050", {}),
    "mobilenetv3_small_050": ("MobileNet", "mobilenetv3_small_050", {}),
    "convnext_atto": ("ConvNeXt", "convnext_atto", {}),
    "convnextv2_atto": ("ConvNeXt", "convnextv2_atto", {}),
    "vit_tiny": ("ViT", "vit_tiny_patch16_224", {"img_size": SIZE, "depth": 4}),
    "deit_tiny": ("ViT", "deit_tiny_patch16_224", {"img_size": SIZE, "depth": 4}),
    "swin_tiny": (
        "Swin",
        "swin_tiny_patch4_window7_224",
        {"img_size": SIZE, "window_size": 4, "embed_dim": 32, "depths": (1, 1, 2, 1)},
    ),
    "regnetx_002": ("RegNet", "regnetx_002", {}),
    "regnety_002": ("RegNet", "regnety_002", {}),
    "densenet121": ("DenseNet", "densenet121", {}),
    "mixer_s32": ("MLP-Mixer", "mixer_s32_224", {"img_size": SIZE}),
    "ghostnet_050": ("GhostNet", "ghostnet_050", {}),
    "mobilevit_xxs": ("MobileViT", "mobilevit_xxs", {}),
    "poolformer_s12": ("MetaFormer", "poolformer_s12", {}),
    "dla46_c": ("DLA", "dla46_c", {}),
    "repvgg_a0": ("RepVGG", "repvgg_a0", {}),
    "rexnet_100": ("ReXNet", "rexnet_100", {}),
    "edgenext_xx_small": ("EdgeNeXt", "edgenext_xx_small", {}),
    "efficientvit_b0": ("EfficientViT", "efficientvit_b0", {}),
    "cait_xxs24": ("CaiT", "cait_xxs24_224", {"img_size": SIZE, "depth": 4}),
    "eva02_tiny": ("EVA", "eva02_tiny_patch14_224", {"img_size": 56, "depth": 4}),
}


def build(arch: str):
    """The architecture's model (random seeded weights), a batch of images and its labels."""
    import timm
    import torch

    _, name, kwargs = ARCHS[arch]
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=10, **kwargs)
    for module in model.modules():  # no random draws (stochastic depth, dropout): runs compare
        if isinstance(module, torch.nn.Dropout) or hasattr(module, "drop_prob"):
            module.p = module.drop_prob = 0.0
        if isinstance(getattr(module, "drop_rate", None), float):  # F.dropout(x, self.drop_rate)
            module.drop_rate = 0.0
    size = kwargs.get("img_size", SIZE)
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(2, 3, size, size, generator=g), torch.tensor([3, 7])


def _step(model, fn, images, labels) -> dict:
    """fn(images)'s cross entropy, backpropagated: the loss and `model`'s gradients by name."""
    import torch

    loss = torch.nn.functional.cross_entropy(fn(images), labels)
    model.zero_grad(set_to_none=True)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.detach(), **grads}


def _compiled(model, backend: str):
    import torch

    options = {"fallback": "error"} if backend == "tpu_inductor" else None
    return torch.compile(model, backend=backend, options=options, fullgraph=True)


def _run(model, images, labels, fn=lambda m: m) -> dict:
    """The eval-mode output, then the train-mode step, of `fn(copy of model)`."""
    import torch

    with torch.no_grad():
        out = fn(copy.deepcopy(model).eval())(images)
    torch._dynamo.reset()
    trained = copy.deepcopy(model).train()
    return {"out": out, **_step(trained, fn(trained), images, labels)}


def _rmse(a, b) -> float:
    return (a.double() - b.double()).square().mean().sqrt().item()


def unequal(found: dict, eager: dict, exact: dict) -> list[str]:
    """The names of `found`'s tensors (output, loss, gradients) not equal to eager float32's:
    equal is assert_close at TOL, or, as Dynamo's own accuracy checks judge against a float64
    run, no further from float64 than twice eager float32 plus 1e-5 (root mean square). The
    second is for values float32 cannot resolve: a bias before a batch norm has a gradient of
    exactly zero, which float32 gives as noise."""
    import torch

    missing = sorted(eager.keys() - found.keys())
    return missing + [
        k
        for k, e in eager.items()
        if k in found
        and not torch.allclose(found[k], e, **TOL)
        and _rmse(found[k], exact[k]) > 2 * _rmse(e, exact[k]) + 1e-5
    ]


def check(arch: str, backend: str, reference: dict) -> dict:
    """One backend on one architecture against the eager references; the row of the table."""
    import torch

    from tpu_inductor.debug import records

    model, images, labels = build(arch)
    row = {"arch": arch, "family": ARCHS[arch][0], "backend": backend}
    torch._dynamo.reset()
    first = len(records.records)
    try:
        found = _run(model, images, labels, lambda m: _compiled(m, backend))
        bad = unequal(found, reference["float32"], reference["float64"])
        assert not bad, f"{len(bad)} tensors not equal to eager: {bad[:4]}"
        ours = records.records[first:]
        whole = [r.graph for r in ours if r.status != "ok" or r.fallback or "." in r.graph]
        assert not whole, f"graphs not compiled whole: {whole}"
        row["ok"] = True
    except Exception as e:  # the table names every failure; nothing is retried
        row["ok"] = False
        row["reason"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
        row["trace"] = traceback.format_exc(limit=-3)[-1500:]
    return row


def _reference(arch: str) -> dict:
    model, images, labels = build(arch)
    return {
        "float32": _run(model, images, labels),
        "float64": _run(model.double(), images.double(), labels),
    }


def table(rows: list[dict]) -> str:
    """Markdown: architecture, family, then each backend's pass or failure reason."""
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    by = {(r["arch"], r["backend"]): r for r in rows}
    lines = [
        "| arch | family | " + " | ".join(backends) + " |",
        "|---|---|" + "---|" * len(backends),
    ]
    for arch in dict.fromkeys(r["arch"] for r in rows):
        cells = []
        for b in backends:
            r = by.get((arch, b))
            cells.append("-" if r is None else "pass" if r["ok"] else f"FAIL {r['reason'][:120]}")
        lines.append(f"| {arch} | {ARCHS[arch][0]} | " + " | ".join(cells) + " |")
    for b in backends:
        done = [r for r in rows if r["backend"] == b]
        lines.append(f"\n{b}: {sum(r['ok'] for r in done)}/{len(done)} pass")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", default=",".join(ARCHS))
    parser.add_argument("--backends", default="tpu_inductor,inductor")
    parser.add_argument("--json", help="append each row to this file (JSON lines)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    rows = []
    for arch in args.archs.split(","):
        reference = _reference(arch)
        for backend in args.backends.split(","):
            row = check(arch, backend, reference)
            rows.append(row)
            line = json.dumps({k: v for k, v in row.items() if k != "trace"})
            print(line if row["ok"] else line + "\n" + row["trace"], flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
