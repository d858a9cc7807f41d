"""What happened in each compile: stage timings, dumps, structured traces.

One observer per graph (`GraphObserver`) sees its graph-level stages (the ATen graph, the graph
after each pass, the partition) and opens one `CompileRecord` per compiled specialization, whose
`run(stage, fn)` times each later stage and shows what it made: the stages themselves hold no
debug calls. The benchmark's cold-start breakdown and `tpu-inductor explain` read these records.
Around them, this module makes every stage visible:

- With `dump_dir` (option or `TPU_INDUCTOR_DUMP_DIR`), each record gets one folder,
  `<dump_dir>/<id>_<graph>/`, of numbered stage files: the Dynamo graph, the ATen graph, the
  graph after each pass with a diff, StableHLO with and without locations, the optimized HLO,
  and `compile.json` (timings, cache decision, inputs, recompile reason, fallback ops).
- The same payloads go out as `torch._logging.trace_structured` artifacts named
  `tpu_inductor_<graph>_<stage>`, so `TORCH_TRACE=dir` + `tlparse` show them per compile id.
- `TORCH_LOGS="+tpu_inductor"` (or `+tpu_inductor.lowering`, `.passes`, `.cache`) turns on our
  loggers; at DEBUG the `tpu_inductor_graphs` artifact prints every graph stage.
- A graph compiled again (same fingerprint, other inputs or options) logs one line that says
  what changed, from what to what, and what would avoid it (recompiles.py).
- A failed PJRT compile writes a reproducer folder and names it in the error (repro.py).

Graph-level stages (before a record exists) are kept in memory, by graph name, only while
dumping, and copied into the folder of each record of that graph. This module imports none of
the other rooms (it reads `lowered.text` and `executable.hlo_modules()` by duck typing).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import itertools
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tpu_inductor import files
from tpu_inductor.config import Options
from tpu_inductor.debug import profiling
from tpu_inductor.debug.recompiles import describe_input, explain_if_recompile
from tpu_inductor.debug.repro import repro_command, write_reproducer
from tpu_inductor.exc import CompileError

log = logging.getLogger(__name__)

_ids = itertools.count()
_graph_ids = itertools.count()


def graph_name(kind: str) -> str:
    """A new graph's name in logs and dump folders: its kind and a number unique here."""
    return f"{kind}_{next(_graph_ids)}"


# Our names in torch's logging registry: `torch._logging.set_logs(modules={name: level})`.
# (TORCH_LOGS reads module names too, e.g. "+tpu_inductor.lowering": it is parsed when torch is
# imported, before these aliases exist, so it takes the dotted module names.)
_LOGS = {
    "tpu_inductor": "tpu_inductor",
    "tpu_inductor_lowering": "tpu_inductor.lowering",
    "tpu_inductor_passes": "tpu_inductor.passes",
    "tpu_inductor_cache": "tpu_inductor.cache",
}
for _alias, _qname in _LOGS.items():
    torch._logging._internal.register_log(_alias, _qname)
torch._logging._internal.register_artifact(
    "tpu_inductor_graphs", "tpu_inductor's graph at each compile stage (ATen, passes, StableHLO)"
)
graph_log = torch._logging.getArtifactLogger(__name__, "tpu_inductor_graphs")


@dataclasses.dataclass
class CompileRecord:
    """One compiled specialization of one graph."""

    graph: str  # a short name of the graph, e.g. "forward_3"
    inputs: tuple  # the input signature it was compiled for
    timings: dict[str, float] = dataclasses.field(default_factory=dict)  # stage → seconds
    cache: dict[str, Any] = dataclasses.field(default_factory=dict)  # decision, key digest, ...
    id: int = dataclasses.field(default_factory=lambda: next(_ids))
    fingerprint: str | None = None  # the graph's fingerprint (same graph → same fingerprint)
    options: dict[str, Any] = dataclasses.field(default_factory=dict)  # cache-key options
    compile_id: Any = None  # Dynamo's CompileId ("0/1") of the graph, when Dynamo traced it
    recompile: str | None = None  # why this graph was compiled again, if it was
    fallback: dict[str, Any] = dataclasses.field(default_factory=dict)  # op → count, sites
    passes: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)  # rewrites
    # Shape bucketing: the bucket and the true sizes that asked for it, or why the graph is not
    # bucketed (None: no policy, or no symbolic size).
    bucketing: dict[str, Any] | None = None
    # What one call moves between host and device (runtime.CompiledGraph.transfer_summary).
    transfers: dict[str, Any] | None = None
    # Over a device mesh: the collectives and per-device memory of the executable
    # (collectives.report).
    communication: dict[str, Any] | None = None
    # XLA's memory analysis of the executable, per device, and what a call needs beyond the
    # resident state (runtime.CompiledGraph.memory_summary): plain numbers from the caller.
    memory: dict[str, int] | None = None
    # The lowering rules' choices: attention kernels chosen, XLA fallbacks and why.
    kernels: dict[str, int] = dataclasses.field(default_factory=dict)
    error: str | None = None  # the last failure inside a stage (a recovered cache fault too)
    status: str = "compiling"  # then "ok" or "failed"
    dump_path: Path | None = None  # this record's dump folder, when dumping
    files: list[str] = dataclasses.field(default_factory=list)  # stage files written
    _module_text: str | None = dataclasses.field(default=None, repr=False)  # for a reproducer
    _platform: str = dataclasses.field(default="", repr=False)

    @contextlib.contextmanager
    def stage(self, name: str):
        """Time a stage; repeated stages add up. A failure inside is recorded (and re-raised)."""
        start = time.perf_counter()
        ranged = profiling.span("compile", f"{self.graph} {name}") if profiling.active else None
        try:
            with ranged or contextlib.nullcontext():
                yield
        except Exception as e:
            self._add_time(name, start)  # before compile.json is written, so it has the time
            self.status, self.error = "failed", f"{name}: {type(e).__name__}: {e}"
            _write_compile_json(self)
            raise
        self._add_time(name, start)

    def _add_time(self, name: str, start: float) -> None:
        seconds = time.perf_counter() - start
        self.timings[name] = self.timings.get(name, 0.0) + seconds
        if profiling.active:
            profiling.compiled(self.graph, name, seconds)

    def run(self, name: str, fn: Callable[[], Any]) -> Any:
        """Stage `name` of this record: `fn()` timed, its result shown (`show`). A PJRT compile
        that fails writes a reproducer of the module shown last and names it in the error."""
        with self.stage(name):
            try:
                value = fn()
            except CompileError as e:
                if self._module_text is None:
                    raise
                path = write_reproducer(self, self._module_text, self._platform, str(e))
                raise CompileError(
                    f"{e}\nA reproducer (the StableHLO module) is in {path}; recompile it "
                    f"with:\n  {repro_command(path)}"
                ) from e
        self.show(value)
        return value

    def show(self, value: Any) -> None:
        """Dump what a stage made, by what it is: a lowered module (StableHLO, with and without
        source locations) or an executable (its optimized HLO)."""
        if hasattr(value, "hlo_modules"):
            dump_stage(
                self,
                "optimized_hlo",
                lambda: "\n\n".join(m.to_string() for m in value.hlo_modules()),
                ".txt",
            )
        elif hasattr(value, "text") and hasattr(value, "bytecode"):
            self._module_text, self._platform = value.text, value.platform
            self.kernels = dict(getattr(value, "kernel_choices", {}))
            dump_stage(self, "stablehlo", value.text, ".mlir")
            if getattr(value, "text_with_locations", ""):
                dump_stage(self, "stablehlo_locations", value.text_with_locations, ".mlir")

    @property
    def label(self) -> str:
        """The record's folder name and trace-artifact prefix: `<id>_<graph>`."""
        return f"{self.id:03d}_{self.graph}"


# Every record of this process, oldest first (tests and the benchmark read them).
records: list[CompileRecord] = []


@dataclasses.dataclass
class _Stage:
    name: str  # e.g. "aten_forward", "pass_cleanup"
    files: dict[str, str]  # file extension → text, e.g. {".py": ..., ".diff": ...}


@dataclasses.dataclass
class _GraphState:
    """What happened to a graph before its records: stages (when dumping), fallback, passes."""

    stages: list[_Stage] = dataclasses.field(default_factory=list)
    fallback: dict[str, Any] = dataclasses.field(default_factory=dict)
    passes: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)


# graph name (or "dynamo:<compile id>") → its state; filled only while dumping.
_graphs: dict[str, _GraphState] = {}


def _active(options: Options | None) -> bool:
    """Whether anyone will read stage payloads: a dump folder, a trace or the graphs log."""
    from torch._logging._internal import trace_log

    dumping = options is not None and options.dump_dir is not None
    return dumping or bool(trace_log.handlers) or graph_log.isEnabledFor(logging.DEBUG)


def readable(gm: torch.fx.GraphModule) -> str:
    """A graph as Python with each value's dtype and shape and the user's source lines."""
    return gm.print_readable(print_output=False, include_stride=False, include_device=False)


# graph name → Dynamo's compile id when it was traced (specializations compile later, at run
# time, outside Dynamo's context: their records and artifacts are filed under this id).
_compile_ids: dict[str, Any] = {}


def _compile_id(graph: str | None = None):
    """Dynamo's current CompileId, else the one graph `graph` (or its parent) was traced under."""
    from torch._guards import CompileContext

    current = CompileContext.current_compile_id()
    if current is not None or graph is None:
        return current
    return _compile_ids.get(graph) or _compile_ids.get(graph.rpartition(".")[0])


def _state(name: str) -> _GraphState:
    """The state of graph `name`, started from its parent's (a region "g.fused_0" of "g") or,
    for a whole graph, from the Dynamo graph of the current compile id."""
    if name not in _graphs:
        parent, _, _ = name.rpartition(".")
        origin = _graphs.get(parent or f"dynamo:{_compile_id()}", _GraphState())
        _graphs[name] = _GraphState(list(origin.stages), dict(origin.fallback))
    return _graphs[name]


def _emit(label: str, stage: _Stage, graph: str | None) -> None:
    """Send a stage to the structured trace (under graph's compile id) and the graphs log."""
    for ext, text in stage.files.items():
        name = f"tpu_inductor_{label}_{stage.name}_{ext.lstrip('.')}"
        torch._logging.trace_structured(
            "artifact",
            metadata_fn=lambda name=name: {"name": name, "encoding": "string"},
            payload_fn=lambda text=text: text,
            expect_trace_id=False,
            compile_id=_compile_id(graph),
        )
        graph_log.debug("%s %s%s:\n%s", label, stage.name, ext, text)


def dynamo_graph(gm: torch.fx.GraphModule, options: Options) -> None:
    """Stage 0: the graph Dynamo handed the backend (parent of its forward/backward graphs)."""
    if not _active(options):
        return
    compile_id = _compile_id()
    stage = _Stage("dynamo_graph", {".py": readable(gm)})
    _emit(f"dynamo_{compile_id}".replace("/", "_"), stage, None)
    if options.dump_dir is not None:
        _graphs[f"dynamo:{compile_id}"] = _GraphState([stage])


def fallback_ops(name: str, missing: dict[str, list[str]], platform: str, options: Options):
    """Ops of graph `name` that run in eager torch, their source lines and why.

    Reported before its regions compile (fallback="eager") or after them (fallback="torch-mlir",
    once torch-mlir had its turn): so the states and records of its regions get them too.
    """
    if options.dump_dir is None:
        return
    fallback = {
        op: {
            "count": len(sites),
            "sites": list(dict.fromkeys(sites)),
            "why": f"no lowering rule for platform {platform!r}",
        }
        for op, sites in sorted(missing.items())
    }
    _state(name).fallback = fallback
    for graph, state in _graphs.items():
        if graph.startswith(f"{name}."):
            state.fallback = fallback
    for record in records:
        if record.graph == name or record.graph.startswith(f"{name}."):
            record.fallback = fallback
            _write_compile_json(record)


class GraphObserver:
    """Sees every stage of one graph before its records: the ATen graph, the graph after each
    pass (with a diff), the partition and its regions; and opens the graph's records. It is the
    pass pipeline's observer (called after each pass) and the one debug hook of the stages."""

    def __init__(self, name: str, options: Options):
        self.name = name
        self.options = options
        self.active = _active(options)
        self._last = ""  # the graph text last shown, for the next pass's diff
        # What the shape bucketing of this graph is (set by the compile stages, and per call
        # by the bucket dispatch: the bucket and true sizes a compile is asked for); a context
        # variable, so that a compile run in a pool (precompile) records the call's bucket.
        self._bucketing = contextvars.ContextVar(f"bucketing of {name}", default=None)
        _compile_ids.setdefault(name, _compile_id())  # recompile explanations read it, too

    @property
    def bucketing(self) -> dict[str, Any] | None:
        return self._bucketing.get()

    @bucketing.setter
    def bucketing(self, value: dict[str, Any] | None) -> None:
        self._bucketing.set(value)

    def graph(self, stage: str, gm: torch.fx.GraphModule) -> None:
        """A graph-level stage (e.g. "aten_forward", "partitioned")."""
        if self.active:
            self._last = readable(gm)
            self._add(_Stage(stage, {".py": self._last}))

    def __call__(self, pass_name: str, gm: torch.fx.GraphModule, rewrites: dict[str, int]):
        """After pass `pass_name`: the graph and its diff from the graph before the pass (not
        for a pass that rewrote nothing: the graph is the one before it)."""
        if self.options.dump_dir is not None:
            _state(self.name).passes[pass_name] = dict(rewrites)
        if not self.active or not rewrites:
            return
        text = readable(gm)
        header = f"# pass {pass_name}: rewrites {rewrites or 'none'}\n"
        diff = difflib.unified_diff(
            self._last.splitlines(keepends=True),
            text.splitlines(keepends=True),
            f"before {pass_name}",
            f"after {pass_name}",
        )
        self._last = text
        self._add(_Stage(f"pass_{pass_name}", {".py": text, ".diff": header + "".join(diff)}))

    def region(
        self, region: str, gm: torch.fx.GraphModule, options: Options | None = None
    ) -> GraphObserver:
        """The observer of a region of this graph (compiled under `options`, by default this
        graph's), which starts from this graph's stages."""
        observer = GraphObserver(f"{self.name}.{region}", options or self.options)
        observer.graph("region", gm)
        return observer

    def fallback(self, missing: dict[str, list[str]], platform: str) -> None:
        fallback_ops(self.name, missing, platform, self.options)

    def record(self, inputs: tuple, fingerprint: str | None = None) -> CompileRecord:
        return new_record(
            self.name,
            inputs,
            fingerprint=fingerprint,
            options=self.options,
            bucketing=self.bucketing,
        )

    def _add(self, item: _Stage) -> None:
        _emit(self.name, item, self.name)
        if self.options.dump_dir is not None:
            _state(self.name).stages.append(item)


def new_record(
    graph: str,
    inputs: tuple,
    *,
    fingerprint: str | None = None,
    options: Options | None = None,
    bucketing: dict[str, Any] | None = None,
) -> CompileRecord:
    """Open the record of one compile of `graph` for `inputs`; explain it if it recompiles."""
    compile_id = _compile_id(graph)
    record = CompileRecord(graph, inputs, fingerprint=fingerprint, compile_id=compile_id)
    record.bucketing = None if bucketing is None else dict(bucketing)
    if options is not None:
        record.options = options.cache_key_entries()
    if fingerprint is not None:
        explain_if_recompile(record, records)
    records.append(record)
    if options is not None and options.dump_dir is not None:
        _open_folder(record, Path(options.dump_dir))
    return record


def _open_folder(record: CompileRecord, root: Path) -> None:
    path = root / record.label
    if path.exists():  # another process numbered its records alike
        path = root / f"{record.label}.{os.getpid()}"
    path.mkdir(parents=True, exist_ok=True)
    record.dump_path = path
    state = _state(record.graph)
    record.fallback, record.passes = state.fallback, dict(state.passes)
    for stage in state.stages:
        _write_stage(record, stage)
    _write_compile_json(record)


def _write_stage(record: CompileRecord, stage: _Stage) -> None:
    number = len({name.split("_", 1)[0] for name in record.files})
    for ext, text in stage.files.items():
        file_name = f"{number:02d}_{stage.name}{ext}"
        (record.dump_path / file_name).write_text(text)
        record.files.append(file_name)


def dump_stage(record: CompileRecord, stage: str, text: str | Callable[[], str], ext: str):
    """A stage of one record (e.g. "stablehlo"); `text` may be a function, called only if read."""
    if record.dump_path is None and not _active(None):
        return
    item = _Stage(stage, {ext: text() if callable(text) else text})
    _emit(record.label, item, record.graph)
    if record.dump_path is not None:
        _write_stage(record, item)


def finish(record: CompileRecord) -> None:
    """Close a record after a successful compile (or cache hit): write compile.json."""
    record.status = "ok"
    _write_compile_json(record)
    torch._logging.trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": f"tpu_inductor_{record.label}_compile", "encoding": "json"},
        payload_fn=lambda: compile_summary(record),
        expect_trace_id=False,
        compile_id=record.compile_id,
    )


def compile_summary(record: CompileRecord) -> dict[str, Any]:
    """What compile.json holds: everything known about one compile, as JSON values."""
    return {
        "id": record.id,
        "graph": record.graph,
        "compile_id": None if record.compile_id is None else str(record.compile_id),
        "status": record.status,
        "error": record.error,
        "inputs": [describe_input(v) for v in record.inputs],
        "timings": record.timings,
        "total_s": sum(record.timings.values()),
        "cache": record.cache,
        "recompile_reason": record.recompile,
        "options": {k: list(v) if isinstance(v, tuple) else v for k, v in record.options.items()},
        "fallback_ops": record.fallback,
        "pass_rewrites": record.passes,
        "bucketing": record.bucketing,
        "transfers": record.transfers,
        "communication": record.communication,
        "memory": record.memory,
        "kernel_choices": record.kernels,
        "fingerprint": record.fingerprint,
        "files": record.files,
    }


def _write_compile_json(record: CompileRecord) -> None:
    """Write (or rewrite) compile.json atomically: a reader never sees half of it."""
    if record.dump_path is None:
        return
    text = json.dumps(compile_summary(record), indent=1, default=str)
    files.write_atomic(record.dump_path / "compile.json", text + "\n")
