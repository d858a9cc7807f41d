"""Issue 38, candidate (B): meta tensors as handles of device-only state, measured.

A parameter (or buffer) is replaced by a tensor on device "meta" of the same shape and dtype; its
value is kept aside (``REAL``, keyed by the meta StorageImpl; jax arrays in the RSS part) and a
toy backend maps meta inputs to their values and runs the graph with torch (standing for the
device execution). It answers: does Dynamo + AOTAutograd trace such a model (Sequential of
Linears, a small transformers Llama), what do the outputs and gradients look like, what does
eager code get when it touches the parameter, does AdamW run on it, and the process RSS of the
device copy alone against eager and against candidate (A) (CPU storages whose pages are given
back with madvise(MADV_DONTNEED)). Each RSS figure comes from a fresh subprocess.

    nice -n 19 .venv/bin/python tools/mechanism_meta_handles.py    # prints the markdown tables
"""

from __future__ import annotations

import ctypes
import io
import re
import subprocess
import sys
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

warnings.filterwarnings("ignore")
# A handle is its meta StorageImpl (so detach() and views keep it); the entry pins the storage,
# not the tensor, so autograd may keep a returned gradient as p.grad (it clones when it can't).
REAL: dict[int, tuple[torch.UntypedStorage, torch.Tensor]] = {}
ROWS: list[tuple[str, str, str]] = []
RETARGETED: list[str] = []  # graph nodes whose device=meta the toy backend rewrote


def handle(value: torch.Tensor, meta: torch.Tensor | None = None) -> torch.Tensor:
    meta = torch.empty_like(value, device="meta") if meta is None else meta
    storage = meta.untyped_storage()
    REAL[storage._cdata] = (storage, value)
    return meta


def known(t: torch.Tensor) -> bool:
    return t.untyped_storage()._cdata in REAL


def real(t):
    if not isinstance(t, torch.Tensor) or t.device.type != "meta":
        return t
    if not known(t):
        raise KeyError(f"meta input {tuple(t.shape)} has no device value (not a known handle)")
    return REAL[t.untyped_storage()._cdata][1]


def to_meta(module: nn.Module) -> nn.Module:
    """Every parameter and buffer becomes a meta handle; the values go to REAL."""
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        owner_name, _, leaf = name.rpartition(".")
        owner, value = module.get_submodule(owner_name), t.detach().clone()
        if isinstance(t, nn.Parameter):
            meta = nn.Parameter(torch.empty_like(t, device="meta"), requires_grad=t.requires_grad)
            setattr(owner, leaf, handle(value, meta))
        else:
            owner.register_buffer(leaf, handle(value))
    return module


def meta_backend(meta_grads: bool = True):
    """AOTAutograd with a forward that runs on the values of its meta inputs and a backward that
    returns a meta handle for the gradient of each meta primal (real tensors elsewhere)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    primal_meta: list[bool] = []

    def retarget(gm):  # factory ops traced with device=meta: the device stands for "ours"
        for n in gm.graph.nodes:
            if n.kwargs.get("device") == torch.device("meta"):
                n.kwargs = {**n.kwargs, "device": torch.device("cpu")}
                RETARGETED.append(f"{n.target}")
        gm.recompile()

    def fw(gm, example):
        retarget(gm)
        primal_meta[:] = [getattr(e, "device", None) == torch.device("meta") for e in example]
        return make_boxed_func(lambda *args: gm(*[real(a) for a in args]))

    def bw(gm, example):
        retarget(gm)

        def run(*args):
            grads = gm(*[real(a) for a in args])
            meta = (primal_meta if meta_grads else []) + [False] * len(grads)
            return [handle(g) if g is not None and meta[i] else g for i, g in enumerate(grads)]

        return make_boxed_func(run)

    return aot_autograd(fw_compiler=fw, bw_compiler=bw)


def case(group: str, name: str, fn) -> None:
    try:
        out = str(fn())
    except Exception as e:  # noqa: BLE001 - every failure is an outcome to report
        msg = " / ".join([ln.strip() for ln in str(e).splitlines() if ln.strip()][:2])
        out = f"**{type(e).__name__}**: {re.sub(r' at 0x[0-9a-f]+', '', msg)[:230]}"
    ROWS.append((group, name, out.replace("|", "\\|").replace("\n", " ")))


def dev(t) -> str:
    return "None" if t is None else f"{type(t).__name__} on {t.device}"


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, vocab_size=1024,
                      attn_implementation="sdpa")  # fmt: skip
    return LlamaForCausalLM(cfg)


def tracing() -> None:
    g = "1 compile"
    x, ref = torch.randn(4, 16), mlp()
    ref_out = ref(x)
    ref_out.sum().backward()

    case(g, "MLP eager, meta params, CPU input", lambda: to_meta(mlp())(x))
    torch._dynamo.reset()
    case(g, "MLP compiled, meta params, CPU input",
         lambda: dev(torch.compile(to_meta(mlp()), backend=meta_backend())(x)))  # fmt: skip

    def mlp_meta_input():
        torch._dynamo.reset()
        m = to_meta(mlp())
        out = torch.compile(m, backend=meta_backend())(handle(x))
        close = torch.allclose(out, ref_out)
        out.sum().backward()
        w = m[0].weight
        grad_ok = torch.allclose(real(w.grad), ref[0].weight.grad)
        torch.compile(m, backend=meta_backend())(handle(x)).sum().backward()  # accumulate
        acc = "2x (right)" if torch.allclose(real(w.grad), 2 * ref[0].weight.grad) else "not 2x"
        return (f"out: {dev(out)}, equals eager: {close}; loss.backward() OK; p.grad: "
                f"{dev(w.grad)} (value behind the handle equals eager: {grad_ok}); a 2nd "
                f"backward accumulates meta += meta: value behind p.grad's handle is {acc}, "
                f"1x eager: {torch.allclose(real(w.grad), ref[0].weight.grad)}")  # fmt: skip

    case(g, "MLP compiled, meta params, input as a meta handle too", mlp_meta_input)
    torch._dynamo.reset()
    cm = torch.compile(to_meta(mlp()), backend=meta_backend(meta_grads=False))
    case(g, "same, backward returns CPU grads for meta params",
         lambda: cm(handle(x)).sum().backward())  # fmt: skip

    def mlp_cross_entropy():
        torch._dynamo.reset()
        m, y = to_meta(mlp()), torch.randint(0, 4, (4,))
        fn = torch.compile(lambda a, b: F.cross_entropy(m(a), b), backend=meta_backend())
        loss = fn(handle(x), handle(y))
        ok = torch.allclose(loss, F.cross_entropy(ref(x), y))
        loss.backward()
        return f"loss: {dev(loss)}, equals eager: {ok}; backward runs; p.grad: {m[0].weight.grad}"

    case(g, "MLP + F.cross_entropy in the graph, input and labels as meta handles",
         mlp_cross_entropy)  # fmt: skip

    ids = torch.randint(0, 1024, (2, 16))
    lref = llama()
    lref_out = lref(ids, labels=ids)

    def llama_case(meta_ids: bool, use_cache: bool):
        torch._dynamo.reset()
        RETARGETED.clear()
        m = to_meta(llama())
        arg = handle(ids) if meta_ids else ids
        loss = torch.compile(m, backend=meta_backend())(arg, labels=arg, use_cache=use_cache).loss
        same = torch.allclose(loss, lref_out.loss, atol=1e-5)
        loss.backward()
        p, r = m.model.embed_tokens.weight, lref.model.embed_tokens.weight.grad
        ok = f"{torch.allclose(real(p.grad), r)} (norm {real(p.grad).norm():.3g}, eager {r.norm():.3g})"
        return (f"loss: {dev(loss)}, equals eager: {same}; backward OK; embed grad: "
                f"{dev(p.grad)}, value behind the handle equals eager: {ok}; the toy backend had "
                f"to rewrite device=meta in {len(RETARGETED)} graph nodes "
                f"({', '.join(sorted(set(RETARGETED)))})")  # fmt: skip

    lref_out.loss.backward()
    llama_id = "Llama compiled, meta params+buffers,"
    case(g, f"{llama_id} CPU input_ids", lambda: llama_case(False, True))
    case(g, f"{llama_id} CPU input_ids, use_cache=False", lambda: llama_case(False, False))
    case(g, f"{llama_id} meta-handle input_ids, use_cache=False", lambda: llama_case(True, False))


def eager_touch() -> None:
    g = "2 eager"
    p = to_meta(mlp())[0].weight
    case(g, "p + 1", lambda: repr(p + 1))
    case(g, "print(p)", lambda: repr(p))
    case(g, "p.numpy()", lambda: p.detach().numpy())
    case(g, "p.tolist()", lambda: p.tolist())
    case(g, "p.sum().item()", lambda: p.sum().item())
    case(g, "p.to('cpu')", lambda: p.to("cpu"))
    m = to_meta(mlp())
    case(g, "model.state_dict()", lambda: repr(m.state_dict()["0.weight"]))

    def save_load():
        torch.save(m.state_dict(), buf := io.BytesIO())
        back = torch.load(io.BytesIO(buf.getvalue()))["0.weight"]
        data = sum(t.numel() * 4 for t in m.state_dict().values())
        return f"no error; writes {buf.tell()} bytes (data alone: {data}); load gives {dev(back)}"

    case(g, "torch.save(model.state_dict(), buf)", save_load)

    def load():
        before = real(m[0].weight).clone()
        r = m.load_state_dict({k: v + 1 for k, v in mlp().state_dict().items()})
        same = torch.equal(real(m[0].weight), before)
        return f"{r}; p still {dev(m[0].weight)}, the loaded values went nowhere: {same}"

    case(g, "load_state_dict(CPU weights)", load)


def optimizer() -> None:
    g = "4 AdamW"

    def run(compiled: bool):
        torch._dynamo.reset()
        m = to_meta(mlp())
        for p in m.parameters():
            p.grad = handle(torch.ones_like(real(p)))
        before, opt = real(m[0].weight).clone(), torch.optim.AdamW(m.parameters(), lr=0.1)
        (torch.compile(opt.step, backend=meta_backend()) if compiled else opt.step)()
        st, changed = opt.state[m[0].weight], not torch.equal(real(m[0].weight), before)
        return (f"step ran; exp_avg: {dev(st['exp_avg'])} (a handle: {known(st['exp_avg'])})"
                f"; value behind the param handle updated: {changed}")  # fmt: skip

    case(g, "AdamW(meta params, meta-handle grads).step() eager", lambda: run(False))
    case(g, "torch.compile(opt.step) with the meta backend", lambda: run(True))


LIBC = ctypes.CDLL("libc.so.6", use_errno=True)


def rss_mib() -> float:
    LIBC.malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def rss_child(mode: str) -> None:
    """Prints RSS growth in MiB over the imports for one way of holding 16 x Linear(2048, 2048)."""
    import jax
    import numpy as np

    jax.device_put(np.zeros(4)).block_until_ready()
    base, keep = rss_mib(), []
    with torch.device("meta" if mode == "meta" else "cpu"):
        model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(16)])
    for p in model.parameters() if mode != "eager" else []:  # one at a time; jax copy kept
        value = torch.randn(p.shape) if mode == "meta" else p.detach()
        keep.append(jax.device_put(value.numpy().copy()).block_until_ready())
        if mode == "madvise":  # (A): give the storage's whole pages back to the OS
            start, n = p.untyped_storage().data_ptr(), p.untyped_storage().nbytes()
            lo, hi = -(-start // 4096) * 4096, (start + n) // 4096 * 4096
            assert LIBC.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), 4) == 0
    print(f"{rss_mib() - base:.1f} {sum(a.nbytes for a in keep) / 2**20:.1f}")


def rss() -> list[tuple[str, ...]]:
    rows = []
    for mode, what in [("eager", "eager: CPU parameters"),
                       ("meta", "B: meta params, values only as jax arrays (device copy)"),
                       ("madvise", "A: CPU params + jax copy, storages madvise(DONTNEED)")]:  # fmt: skip
        out = subprocess.run([sys.executable, __file__, "--rss", mode], capture_output=True,
                             text=True, check=True).stdout.split()  # fmt: skip
        rows.append((what, out[0], out[1], f"{float(out[0]) - float(out[1]):.1f}"))
    return rows


def main() -> None:
    tracing()
    eager_touch()
    optimizer()
    print("| part | case | outcome |\n|---|---|---|")
    print("\n".join(f"| {' | '.join(r)} |" for r in ROWS))
    print("\n| 3 RSS, 256 MiB of float32 params | RSS growth MiB | jax arrays MiB | rest MiB |")
    print("|---|---|---|---|\n" + "\n".join(f"| {' | '.join(r)} |" for r in rss()))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rss"]:
        rss_child(sys.argv[2])
    else:
        main()
