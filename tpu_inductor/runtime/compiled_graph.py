"""A compiled graph's call: torch in → device → torch out (the devices and PJRT compiles:
devices.py; the crossings themselves: transfer.py; running the executable: execution.py).

`CompiledGraph.__call__` is the hot path. Everything that can be decided once is decided in
the graph's plan (call_plan.py), built once in `__init__`: which inputs cross as tensors, which
need a dtype cast, which are parameters kept resident on the device (re-sent only when they
change), where each result goes, how outputs are rebuilt. The call reads the plan's fields and
holds the state that changes between calls (the parameters' device copies, the ledger).

This module reads a lowered module's call description (tensor_inputs, outputs, mutations, ...)
but never imports the lowering package.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from tpu_inductor.debug import profiling
from tpu_inductor.runtime import (
    call_plan,
    devices,
    execution,
    ledger,
    memory,
    module_results,
    pending_reads,
    residency,
    transfer,
)
from tpu_inductor.runtime.call_plan import Destination
from tpu_inductor.runtime.host_sync import GRADIENT, host_sync
from tpu_inductor.sharding import distributed
from tpu_inductor.sharding import placement as mesh_placement

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GraphRoles:
    """What the caller's calling convention (AOTAutograd's) makes of a graph's inputs and
    outputs, by position: activations saved for the backward (a backward's inputs, a
    forward's outputs), and mutated inputs whose version counter the caller bumps just before
    the call (AOTAutograd does, for a compiler that writes inputs in place)."""

    saved_inputs: tuple[int, ...] = ()
    saved_outputs: tuple[int, ...] = ()
    bumped_inputs: tuple[int, ...] = ()
    keep_saved: bool = True  # saved outputs stay on the device (option saved_on_device)
    # A backward's outputs (gradients, which a compiled optimizer step takes): their mirrors are
    # found by the tensors' memory too (every graph's outputs are mirrors by identity).
    mirror_outputs: bool = False
    # Per-call inputs that came out of another graph (a gradient): taken from their mirror.
    mirrored_inputs: tuple[int, ...] = ()
    # A backward's gradients of the forward's outputs: autograd's zeros for an output the loss
    # does not read (a model's logits next to its loss) are not sent again (call_plan.py).
    tangent_inputs: tuple[int, ...] = ()
    # host_sync="explicit": the inputs it writes and a backward's gradients stay on the device,
    # their host memory stale until tpu_inductor.sync() (host_sync.py).
    defer_host: bool = False


class CompiledGraph:
    """A compiled executable with the torch calling convention (boxed: takes a list of args).

    `roles` (GraphRoles): saved activations among its inputs (taken from the device where they
    are there) and outputs (returned as residency.DeviceTensor: they stay on the device), and
    the mutated inputs whose version the caller bumps just before the call.
    """

    def __init__(
        self,
        executable,
        lowered,
        device: devices.Device,
        static_inputs: Sequence[int] = (),
        graph_key: Any = None,
        roles: GraphRoles | None = None,
    ):
        self._boxed_call = True  # an instance attribute: wrappers copy __dict__, not the class
        self.executable = executable
        self.lowered = lowered
        self.device = device
        self.graph_key = graph_key  # the compile cache's key of graph and inputs, if cached
        self._transfer = transfer.Transfer(device)
        # Per module argument (the seed last), how it is split over a mesh; None: one device.
        self._shardings = mesh_placement.argument_shardings(device, lowered, executable)
        self._run = execution.Runner(executable, device, lowered)
        facts = call_plan.DeviceFacts(
            mesh=bool(device.mesh),
            zero_copy=self._transfer.on_cpu,
            host_arguments=self._run.fast_path is not None,
        )
        self.plan = call_plan.plan_call(lowered, roles or GraphRoles(), facts, static_inputs)
        # Device copies shared between graphs (over a mesh, moved between its devices where a
        # graph splits them otherwise: Transfer.resharded).
        self._mirror_key = self._transfer.key
        # Parameters and buffers stay on the device while their stamp holds (see
        # `_resident_arguments`), in one state replaced whole: threads calling with the
        # parameters of different modules each use the state they made.
        self._resident = _Resident.empty(len(self.plan.arguments))
        self._zeros: dict[int, Any] = {}  # tangent slot → a device array of zeros
        self._multiprocess = bool(device.mesh) and distributed.active()
        self._seed_agreed = not self._multiprocess  # one process: nothing to agree with
        self.per_call = collections.Counter(dict(self.plan.per_call))  # a steady-state call's
        self._calls = ledger.call_count((*self.per_call.items(), (ledger.CALLS, 1)))
        self._crossed = collections.Counter()  # what crossed besides, by (direction, kind)
        # XLA's memory analysis, read once here; the memory ledger reads the resident arrays
        # (`held_arrays`) when asked.
        self.memory = memory.track(
            self, executable, device, self.plan, self._shardings, lowered, self._calls
        )
        # Over a mesh, the bytes per device its collectives move in one call (the compile
        # stages set it from the collectives report; profiles count it).
        self.collective_bytes = 0

    @property
    def ledger(self) -> collections.Counter:
        """Every call of this graph: bytes by (direction, kind), and the calls (ledger.CALLS)."""
        calls = collections.Counter({self._calls.entries: self._calls.calls})
        return ledger.summed(calls, self._crossed)

    def held_arrays(self):
        """(kind, tensor, device array) of the arrays this graph keeps between calls: its
        resident parameters (with their tensors, while alive) and its kept zeros (the memory
        ledger, memory.py, reads them)."""
        state = self._resident
        tensors = state.watched()
        for index, argument in enumerate(self.plan.resident):
            array = state.arguments[argument.slot]
            if array is not None:
                yield "parameters", tensors[index] if index < len(tensors) else None, array
        for array in list(self._zeros.values()):
            yield "mirrors", None, array

    def output_partition_specs(self) -> dict[int, tuple]:
        """Over a mesh: graph output index → the partition spec (per dim, a mesh axis or None)
        of the outputs that stay on the devices, as the partitioner split them, and of the
        inputs returned as they are (a parameter saved for the backward), as the module took
        them (so the backward takes it split so, not gathered first); a layout one axis per
        dim cannot say is left out. Empty on one device."""
        if self._run.result_shardings is None:
            return {}
        results, outputs = self.plan.results, self.lowered.outputs
        kept = {
            index: self._run.result_shardings[slot.result]
            for index, slot in enumerate(outputs)
            if slot.result is not None
            and results[slot.result].goes is Destination.KEPT
            and not slot.view
        }
        specs = mesh_placement.partition_specs(self.device.axes, kept)
        split = self.lowered.shardings
        slots = {position: s for s, position in enumerate(self.lowered.tensor_inputs)}
        for index, slot in enumerate(outputs):
            if slot.result is None and slot.input in slots and not slot.view:
                spec = split.inputs[slots[slot.input]]
                if spec is not None:
                    specs[index] = spec
        return specs

    def transfer_summary(self) -> dict:
        """For compile records: what a steady-state call moves, what the first call moves
        besides (parameters and buffers sent to the device), and what stays there."""
        arguments = self.plan.arguments
        return {
            "per_call": ledger.as_dict(self.per_call),
            "resident_bytes": sum(a.nbytes for a in arguments if a.sent_as == "parameter"),
            "saved_inputs_bytes": sum(a.nbytes for a in arguments if a.sent_as == "saved"),
            "kept_on_device": len(self.plan.kept),
            # buffers the executable updates in place (donated): no second copy on the device
            "donated_bytes": sum(a.nbytes for a in self.plan.donated),
        }

    def memory_summary(self) -> dict | None:
        """For compile records: XLA's memory analysis of the executable, per device (bytes of
        arguments, temporaries, outputs, alias, generated code), and what a call needs beyond
        the resident state (memory.py); None where the client has no analysis."""
        if self.memory.analysis is None:
            return None
        return {**self.memory.analysis, "need": self.memory.need}

    def __call__(self, args: list) -> list:
        if profiling.active:
            return self._profiled(args)
        arrays = self._arguments(args)
        return self._receive(self._run_executable(arrays, args), args)

    def _profiled(self, args: list) -> list:
        """A call in named host ranges (debug/profiling.py), its figures counted; it waits
        for its results, so that `execute` is the device's time to them."""
        name, before = self.memory.name or "graph", self._crossed_bytes()
        start = time.perf_counter()
        with profiling.span("call", name):
            with profiling.span("send", name):
                arrays = self._arguments(args)
            with profiling.span("execute", name):
                executed = time.perf_counter()
                results = self._run_executable(arrays, args)
                for result in results:
                    result.block_until_ready()
                executed = time.perf_counter() - executed
            with profiling.span("receive", name):
                returned = self._receive(results, args)
        host = time.perf_counter() - start - executed
        crossed = self._crossed_bytes() - before
        profiling.called(name, host, executed, crossed, self.memory.need, self.collective_bytes)
        return returned

    def _crossed_bytes(self) -> int:
        return sum(n for entry, n in self.ledger.items() if entry != ledger.CALLS)

    def _arguments(self, args: list) -> list:
        """The module's arguments on the device: resident, sent, looked up (and the seed)."""
        plan = self.plan
        if host_sync.gradients or residency.mirrors.by_memory:  # dead gradients freed first
            residency.drop_dead()
        if plan.resident:
            arrays = list(self._resident_arguments(args))
        else:
            arrays = list(self._resident.arguments)
        to_device, shardings = self._transfer.to_device, self._shardings
        argument = self._transfer.argument
        for a in plan.sent:
            value = args[a.position] if a.cast is None else args[a.position].to(a.cast)
            if a.host:
                arrays[a.slot] = argument(value)
            else:
                arrays[a.slot] = to_device(value, shardings[a.slot])
        if plan.looked_up:
            self._looked_up_arguments(args, arrays)
        for a in plan.published_arguments:
            self._publish(args[a.position], arrays[a.slot])
        if plan.uses_rng:
            seed = torch.randint(-(2**31), 2**31 - 1, (2,), dtype=torch.int32)
            if not self._seed_agreed:  # each process sends its own seed to its devices
                distributed.agree("the random seed of a graph's first call", str(seed.tolist()))
                self._seed_agreed = True
            arrays.insert(0, to_device(seed, shardings[-1]))
        return arrays

    def _run_executable(self, arrays: list, args: list) -> list:
        if self._multiprocess:
            distributed.execution_started()
        results = self._execute(arrays, args)
        self._calls.calls += 1
        return results

    def _receive(self, results: list, args: list) -> list:
        """The results back in torch: returned, written into the inputs the graph mutates."""
        plan = self.plan
        outs = self._outputs(results)
        if self._multiprocess:
            distributed.execution_finished()
        put = residency.mirrors.put_output if plan.outputs_by_memory else residency.mirrors.put
        for r in plan.published:  # (on the CPU, an output reads its array's memory: to_torch)
            put(outs[r], self._mirror_key, results[r])
        for write in plan.write_backs:
            tensor, result = args[write.position], write.result
            if write.deferred and host_sync.defer(
                tensor, results[result], self._mirror_key, self._transfer.to_torch
            ):
                residency.mirrors.put(tensor, self._mirror_key, results[result])
                continue
            if write.part is not None:  # the part written: its pieces fetched
                module_results.write_part(tensor, write.part, outs)
            else:
                tensor.copy_(self._host_value(outs, results, result))
            self._mirror_written(tensor, results[result])
        returned = [
            outs[o.result]
            if o.result is not None
            else o.value
            if o.input is None
            else args[o.input]
            for o in plan.returns
        ]
        for v in plan.views:
            viewed = args[v.base] if v.of_input else outs[v.base]
            if v.dtype is not None:  # a result: contiguous, so its flat view is one
                viewed = viewed.reshape(-1).view(v.dtype)
            returned[v.index] = viewed.as_strided(v.size, v.stride, v.offset)
        args.clear()
        return returned

    def _host_value(self, outs: list, results: list, r: int) -> torch.Tensor:
        """Module result `r` on the host: fetched already, or now (a value left on the device
        for a tensor that turned out not to be its whole storage: counted)."""
        if outs[r] is None:
            result = self.plan.results[r]
            ledger.add([((ledger.DEVICE_TO_HOST, "mutation"), result.nbytes)], self._crossed)
            cast = result.cast
            outs[r] = self._transfer.to_torch(results[r])
            outs[r] = outs[r] if cast is None else outs[r].to(cast)
        return outs[r]

    def _execute(self, arrays: list, args: list) -> list:
        """Run the executable; one jax array per module result. A donated argument's array is
        deleted by the call: one that is another tensor's (a DeviceTensor's) or reads a host
        tensor's memory (the zero-copy CPU's: PJRT deletes a donated array that reads memory
        it does not own and aborts the process at exit, jaxlib 0.10.2's "terminate called
        without an active exception") is copied first, one a checkpoint save still
        reads is waited for (pending_reads.py); if the call fails, the mirrors of the donated
        tensors are dropped (the host tensors, not yet written, are sent again)."""
        donated = self.plan.donated
        if not donated:
            return self._run(arrays)
        if pending_reads.any_held():
            pending_reads.before_donating([arrays[a.argument] for a in donated])
        on_cpu, aliases = self._transfer.on_cpu, self._transfer.aliases
        for a in donated:
            arg = args[a.position]
            if arg.__class__ is residency.DeviceTensor or (
                on_cpu and aliases(arrays[a.argument], arg)
            ):
                arrays[a.argument] = arrays[a.argument].copy()
        try:
            return self._run(arrays)
        except BaseException:
            for a in donated:
                residency.mirrors.discard(args[a.position])
            raise

    def _mirror_written(self, tensor: torch.Tensor, array) -> None:
        """After a write-back: the device holds `tensor`'s new values (`array`), so no graph
        sends it again. On the CPU the mirror reads the tensor's own memory instead (a write
        that bypasses the version counter is seen there, as by every zero-copy argument)."""
        self._publish(tensor, self._transfer.to_device(tensor) if self._transfer.on_cpu else array)

    def _publish(self, tensor: torch.Tensor, array) -> None:
        """`array` holds `tensor`'s values on the device: a mirror for every graph. On the CPU
        only an array that reads the tensor's own memory (a copy would miss writes that bypass
        the version counter)."""
        if not self._transfer.on_cpu or self._transfer.aliases(array, tensor):
            residency.mirrors.put(tensor, self._mirror_key, array)

    def _outputs(self, results) -> list:
        """Module results as torch tensors; those kept on the device as DeviceTensors."""
        to_torch, plan = self._transfer.to_torch, self.plan
        for r in plan.prefetched:
            results[r].copy_to_host_async()
        outs = [
            None
            if p.goes is not Destination.HOST
            else to_torch(x)
            if p.cast is None
            else to_torch(x).to(p.cast)
            for x, p in zip(results, plan.results)
        ]
        for p in plan.kept:
            outs[p.index] = residency.DeviceTensor(
                results[p.index], p.shape, p.dtype, to_torch, self._transfer.key
            )
        on_cpu = self._transfer.on_cpu  # (the CPU's zero-copy tensor costs nothing)
        for p in plan.stale:  # gradients under host_sync="explicit"
            r = p.index
            outs[r] = to_torch(results[r]) if on_cpu else torch.empty(p.shape, dtype=p.dtype)
            host_sync.defer(
                outs[r], results[r], self._mirror_key, to_torch, GRADIENT, release=not on_cpu
            )
        return outs

    def _looked_up_arguments(self, args: list, arrays: list) -> None:
        """The arrays of saved activations, of other graphs' outputs and of tangents: a
        DeviceTensor's own, a mirror's, the zeros kept for a tangent slot (the check reads host
        memory, faster than the link to a TPU), or sent (counted)."""
        key, sent = self._mirror_key, collections.Counter()
        for a in self.plan.looked_up:
            value, slot, cast = args[a.position], a.slot, a.cast
            if (
                value.__class__ is residency.DeviceTensor
                and value.device_key == self._transfer.key
                and cast is None
            ):
                arrays[slot] = self._transfer.resharded(value.array, self._shardings[slot])
                continue
            if cast is None:
                array = residency.mirrors.get(value, key, a.bumped)
                if array is not None:
                    arrays[slot] = self._transfer.resharded(array, self._shardings[slot])
                    continue
            value = value if cast is None else value.to(cast)
            zero = a.zeros and not host_sync.is_stale(value) and not value.any()
            array = self._zeros.get(slot) if zero else None
            if array is None:
                # (kept zeros are a copy: a zero-copy CPU array would read a tensor written later)
                array = self._transfer.to_device(
                    value.clone() if zero else value, self._shardings[slot]
                )
                sent[ledger.HOST_TO_DEVICE, a.sent_as] += a.nbytes
                if zero:
                    self._zeros[slot] = array
                elif cast is None:
                    self._publish(value, array)
            arrays[slot] = array
        if sent:
            ledger.add(sent.items(), self._crossed)

    def _resident_arguments(self, args: list) -> Sequence[Any]:
        """The module's arguments with the parameters' arrays: sent again where they changed
        (none, on a steady-state call).

        A parameter changed when its stamp (residency.stamp: version, storage) did. Its array
        is then another graph's device copy of it if one holds the same stamp (a graph that
        wrote it, or that sent it first: residency.mirrors), else it is sent (counted). On the
        CPU a zero-copy array reads the tensor's memory, so a write that bypasses the version
        counter (`.data`, inference mode) is seen as well; a CPU copy (a non-contiguous,
        misaligned or cast parameter) is sent on every call. Other devices hold copies: such a
        write is not seen there.

        The parameters are not kept alive: when one dies, the state is dropped (its arrays hold
        the memory; and an identity or a storage could then be reused by another tensor).
        """
        tensors = [args[position] for position in self.plan.resident_positions]
        stamp = residency.stamps(tensors)
        state = self._resident
        if stamp != state.stamp:
            return self._resend(tensors, stamp, state).arguments
        if not state.copies:
            return state.arguments
        arguments = list(state.arguments)  # this call's: the state's copies stay as they are
        resident = self.plan.resident
        for index in state.copies:
            arguments[resident[index].slot] = self._send(index, tensors[index])
        return arguments

    def _resend(self, tensors, stamp: list, state: _Resident) -> _Resident:
        """A new state, published: the changed parameters and the CPU copies sent again."""
        previous = state.stamp or [None] * len(stamp)
        arguments, resident = list(state.arguments), self.plan.resident
        copies = []
        for index, (tensor, now, before) in enumerate(zip(tensors, stamp, previous)):
            if now != before or index in state.copies:
                array = self._send(index, tensor)
                arguments[resident[index].slot] = array
                if (
                    self._transfer.on_cpu
                    and not self._transfer.aliases(array, tensor)
                    and not host_sync.is_stale(tensor)  # no host write to see: never re-sent
                ):
                    copies.append(index)
        fresh = _Resident(stamp, tuple(arguments), frozenset(copies))
        fresh.watch(tensors, self)
        replaced, self._resident = self._resident, fresh
        replaced.unwatch()
        return fresh

    def _send(self, index: int, tensor: torch.Tensor):
        """Resident parameter `index` (cast to the module's dtype if need be) on the device:
        a device copy another graph holds at its stamp, else sent (and counted)."""
        a = self.plan.resident[index]
        key = self._mirror_key if a.cast is None else None
        array = None if key is None else residency.mirrors.get(tensor, key, a.bumped)
        if array is not None:
            return self._transfer.resharded(array, self._shardings[a.slot])
        value = tensor if a.cast is None else tensor.to(a.cast)
        array = self._transfer.to_device(value, self._shardings[a.slot])
        ledger.add([((ledger.HOST_TO_DEVICE, a.sent_as), a.nbytes)], self._crossed)
        if key is not None:
            self._publish(tensor, array)
        return array

    def release_parameters(self) -> None:
        """Drop this graph's device copies of its parameters (sent again at the next call): a
        graph run once per parameter version (hoisted.py) need not hold them between."""
        self._resident.unwatch()
        self.drop_state(self._resident)

    def drop_state(self, state: _Resident) -> None:
        """`state` is no longer current (a parameter it holds died)."""
        if self._resident is state:
            self._resident = _Resident.empty(len(state.arguments))


class _Resident(residency.Watched):
    """Parameters on the device: their stamp, the module's argument list with their arrays,
    and which of them are CPU copies (sent on every call); dropped from its graph when a
    parameter dies."""

    def __init__(self, stamp: list, arguments: tuple, copies: frozenset[int]):
        self.stamp, self.arguments, self.copies = stamp, arguments, copies

    @classmethod
    def empty(cls, arguments: int) -> _Resident:
        return cls([], (None,) * arguments, frozenset())
