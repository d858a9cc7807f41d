"""`tpu-inductor bench-shapes`: what shape bucketing saves where sizes vary, per policy.

Workloads on small models built from configs (random weights, seeded):

- generate: `generate()` with the dynamic KV cache on GPT-2 and on Llama (GQA), four prompts x
  `--new-tokens` new tokens; the tokens must equal eager's.
- train: a training run of GPT-2, `--steps` steps at random lengths in 1..`--max-length`
  (batch 2).
- precompile: `tpu_inductor.precompile` of every pow2 bucket 16..`--max-length` of a larger
  GPT-2 (4 layers, 128 wide; inference), with 1 and with `--workers` compile threads: the
  warm-up's seconds (Dynamo's trace included) and compiles.

Each runs under tpu_inductor's policies `exact`, `pow2` and `auto` (its plan saved by an
earlier, unmeasured run of the same workload, then read as a new process would) and Inductor,
in this one process, one after another. Per run: compiles (PJRT compiles for tpu_inductor;
graphs compiled for Inductor, each symbolic over every size), total seconds (compiles
included: on a TPU a compile costs seconds to minutes, so the count is the figure that
carries over, the seconds are this CPU's), and the padded share of the input elements. The
machine's load is reported beside them.
"""

from __future__ import annotations

import functools
import random
import tempfile
import time
from pathlib import Path

import torch

from tpu_inductor.bench.harness import CpuLoad
from tpu_inductor.bench.report import write_outputs
from tpu_inductor.cache import stores
from tpu_inductor.exc import BenchError, OptionError
from tpu_inductor.runtime import buckets as bucketing
from tpu_inductor.runtime import devices
from tpu_inductor.runtime.buckets import precompile

POLICIES = ("exact", "pow2", "auto")
MODES = (*POLICIES, "inductor")
WORKLOADS = ("generate", "train", "precompile")


def _gpt2(max_length: int, layers: int = 2, width: int = 64):
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=layers,
        n_embd=width,
        n_head=4,
        vocab_size=256,
        n_positions=max(2 * max_length, 128),
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    return model


def _llama(max_length: int):
    """A Llama of 2 layers, 64 wide, grouped-query attention (4 query / 2 KV heads)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=max(2 * max_length, 128),
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.LlamaForCausalLM(config)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    return model


GENERATE_MODELS = {"gpt2": _gpt2, "llama": _llama}


def _compiler(mode: str, plan: str | None):
    if mode == "inductor":
        return {"backend": "inductor"}
    shapes = {"policy": mode, **({"plan": plan} if plan else {})}
    return {"backend": "tpu_inductor", "options": {"shapes": shapes, "cache": False}}


def _counted(mode: str):
    """(compiles so far) for the mode: PJRT compiles, or graphs Inductor compiled."""
    if mode == "inductor":
        from torch._dynamo.utils import counters

        return counters["aot_autograd"]["total"]
    return devices.stats["pjrt_compiles"]


def _fresh() -> None:
    """As a new process: no Dynamo graphs, plans read from their files again, no executable
    of an earlier run at hand (the compile caches are off)."""
    torch._dynamo.reset()
    bucketing.forget_plans()
    devices.forget_executables()
    stores.memory_cache.clear()


def _generate(model_name, mode, plan, prompts, new_tokens, expected):
    _fresh()
    model = GENERATE_MODELS[model_name](128).eval()
    model.forward = torch.compile(model.forward, **_compiler(mode, plan))
    start, before = time.perf_counter(), _counted(mode)
    same = True
    for prompt, want in zip(prompts, expected):
        got = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
        same = same and torch.equal(got, want)
    return time.perf_counter() - start, _counted(mode) - before, same


def _train(mode, plan, lengths):
    _fresh()
    model = _gpt2(max(lengths))
    step = torch.compile(model, **_compiler(mode, plan))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    start, before = time.perf_counter(), _counted(mode)
    for n in lengths:
        ids = torch.randint(0, 256, (2, n), generator=generator)
        torch._dynamo.maybe_mark_dynamic(ids, 1)
        step(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return time.perf_counter() - start, _counted(mode) - before, None


def _precompile(workers: int, largest: int) -> dict:
    """Every pow2 bucket 16..largest of a GPT-2 (4 x 128) precompiled in `workers` threads."""
    from tpu_inductor.config import Options

    _fresh()
    shapes = {"policy": "pow2", "min_bucket": 16}
    model = _gpt2(largest, layers=4, width=128).eval()
    compiled = torch.compile(model, **_compiler("pow2", None))
    record = Options.from_user({"shapes": shapes}).shapes
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(0))
    start, before = time.perf_counter(), _counted("pow2")
    buckets = precompile(compiled, (ids,), {0: 1}, largest, record, workers=workers)
    seconds = time.perf_counter() - start
    return {
        "workers": workers,
        "buckets": buckets,
        "seconds": round(seconds, 2),
        "compiles": _counted("pow2") - before,
    }


def _padded_share() -> float | None:
    stats = bucketing.report()
    return max((s["padded_share"] for s in stats), default=None)


def run(
    steps: int,
    max_length: int,
    new_tokens: int,
    modes=MODES,
    workloads=WORKLOADS,
    workers: int = 4,
) -> dict:
    """The `workloads` (generate and train under every mode; precompile); the report."""
    rng = random.Random(0)
    lengths = [rng.randint(1, max_length) for _ in range(steps)]
    prompt_lengths = (5, 9, 13, 20)
    prompts = [
        torch.randint(1, 256, (1, n), generator=torch.Generator().manual_seed(n))
        for n in prompt_lengths
    ]
    expected = {}  # per model, eager's tokens per prompt
    for name, build in GENERATE_MODELS.items() if "generate" in workloads else ():
        reference = build(128).eval()
        expected[name] = [
            reference.generate(p, max_new_tokens=new_tokens, do_sample=False) for p in prompts
        ]
    report = {"steps": steps, "max_length": max_length, "new_tokens": new_tokens, "runs": []}
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    with (
        tempfile.TemporaryDirectory() as folder,
        inductor_config.patch(fx_graph_cache=False, autotune_local_cache=False),
        functorch_config.patch(enable_autograd_cache=False),
        CpuLoad() as load,
    ):  # every mode compiles what it runs: no cache of an earlier run
        runs = [
            (
                "generate",
                name,
                functools.partial(
                    _generate, name, prompts=prompts, new_tokens=new_tokens, expected=want
                ),
            )
            for name, want in expected.items()
        ]
        runs.append(("train", "gpt2", lambda m, p: _train(m, p, lengths)))
        for workload, model, fn in runs:
            if workload not in workloads:
                continue
            plan = str(Path(folder) / f"{workload}-{model}.plan.json")
            for mode in modes:
                if mode == "auto":  # an earlier run saw the sizes and saved its plan
                    fn(mode, plan)
                    bucketing.save_plans()
                bucketing.clear_report()
                seconds, compiles, same = fn(mode, plan if mode == "auto" else None)
                report["runs"].append(
                    {
                        "workload": workload,
                        "model": model,
                        "mode": mode,
                        "compiles": compiles,
                        "seconds": round(seconds, 2),
                        "same_tokens": same,
                        "padded_share": None if mode in ("exact", "inductor") else _padded_share(),
                    }
                )
        if "precompile" in workloads:  # one after another, then in threads, twice
            report["precompile"] = [_precompile(w, max_length) for w in (1, workers) * 2]
    report["machine_load"] = load.result
    return report


def markdown(report: dict) -> str:
    """The report's tables (each workload run; the precompile runs) and the machine's load."""
    runs = [
        "| workload | model | mode | compiles | seconds | padded share | same tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        share = "" if r["padded_share"] is None else f"{100 * r['padded_share']:.1f}%"
        same = "" if r["same_tokens"] is None else str(r["same_tokens"])
        runs.append(
            f"| {r['workload']} | {r['model']} | {r['mode']} | {r['compiles']} | {r['seconds']} "
            f"| {share} | {same} |"
        )
    warm = ["| precompile workers | buckets | compiles | seconds |", "|---|---|---|---|"]
    for r in report.get("precompile", ()):
        warm.append(f"| {r['workers']} | {r['buckets']} | {r['compiles']} | {r['seconds']} |")
    tables = [t for t in (runs, warm) if len(t) > 2]
    return "\n\n".join(map("\n".join, tables)) + f"\n\nmachine load: {report['machine_load']}\n"


CASES = {f"shapes-{w}": w for w in WORKLOADS}  # `tpu-inductor bench shapes-train`, ...


def workloads_of(names) -> tuple[str, ...]:
    """The workloads that `tpu-inductor bench` case names ask (`shapes-train` → train); none
    when no name is a shapes case. Shapes cases run apart from models: mixed, a BenchError."""
    workloads = tuple(CASES[n] for n in names if n in CASES)
    others = [n for n in names if n not in CASES]
    if workloads and others:
        raise BenchError(
            f"bench: the shapes cases {[n for n in names if n in CASES]} run apart from models; "
            f"give {others} in another `tpu-inductor bench` run"
        )
    return workloads


def add_arguments(parser) -> None:
    """The options of the shapes workloads, on `bench-shapes` and on `bench`."""
    group = parser.add_argument_group("shapes cases (bench-shapes, bench shapes-*)")
    group.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    group.add_argument("--max-length", type=int, default=512, help="longest length (512)")
    group.add_argument("--new-tokens", type=int, default=32, help="generated tokens (32)")
    group.add_argument("--workers", type=int, default=4, help="precompile threads (4)")


def add_subcommands(commands) -> None:
    """Add `tpu-inductor bench-shapes` to the CLI (also `tpu-inductor bench shapes-*`)."""
    parser = commands.add_parser(
        "bench-shapes", help="compiles and time per shape policy", description=__doc__
    )
    parser.add_argument(
        "--workloads", default=",".join(WORKLOADS), help=f"of {','.join(WORKLOADS)} (all)"
    )
    parser.add_argument("--modes", help=f"of {','.join(MODES)} (all)")
    add_arguments(parser)
    parser.add_argument("--json", metavar="F", help="write the report as JSON")
    parser.add_argument("--markdown", metavar="F", help="write the table as markdown")
    parser.set_defaults(run=_main)


def _main(args) -> int:
    workloads = tuple(args.workloads.split(","))
    unknown = set(workloads) - set(WORKLOADS)
    if unknown:
        raise OptionError(f"bench-shapes --workloads: {sorted(unknown)}: not of {WORKLOADS}")
    return main(args, workloads)


def main(args, workloads: tuple[str, ...]) -> int:
    """Run `workloads` with the options in `args` (of bench-shapes or bench); print the table."""
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip()) if args.modes else MODES
    unknown = sorted(set(modes) - set(MODES))
    if unknown or not modes:
        raise OptionError(f"--modes {args.modes!r}: shapes cases take modes of {MODES}")
    report = run(
        args.steps, args.max_length, args.new_tokens, modes, workloads, workers=args.workers
    )
    write_outputs(report, markdown(report), args.json, args.markdown)
    return 0
