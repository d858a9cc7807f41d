"""A compiled graph's call: torch in → device → torch out (the devices and PJRT compiles:
devices.py; the crossings themselves: transfer.py; running the executable: execution.py).

`CompiledGraph.__call__` is the hot path. Everything that can be decided once is decided in
`__init__`: which inputs cross as tensors, which need a dtype cast, which are parameters kept
resident on the device (re-sent only when they change), how outputs are rebuilt.

This module reads a lowered module's call description (tensor_inputs, outputs, mutations, ...)
but never imports the lowering package.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any

import torch

from tpu_inductor.runtime import devices, execution, ledger, module_results, residency, transfer
from tpu_inductor.runtime.host_sync import GRADIENT, host_sync, leaves_stale
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
    # does not read (a model's logits next to its loss) are not sent again (see CompiledGraph).
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
        roles = roles or GraphRoles()
        saved_inputs, saved_outputs = roles.saved_inputs, frozenset(roles.saved_outputs)
        # Device copies shared between graphs (none over a mesh: each graph splits its own).
        self._mirror_key = None if device.mesh else self._transfer.key
        sizes = [
            module_results.nbytes(spec, dtype)
            for spec, dtype in zip(lowered.input_specs, lowered.module_input_dtypes)
        ]
        inputs = [  # (argument slot, graph input position, dtype to cast to first, or None)
            (slot, position, module_dtype if spec.dtype != module_dtype else None)
            for slot, (position, spec, module_dtype) in enumerate(
                zip(lowered.tensor_inputs, lowered.input_specs, lowered.module_input_dtypes)
            )
        ]
        static, saved = frozenset(static_inputs), frozenset(saved_inputs) - frozenset(static_inputs)
        # Buffers the graph writes (a static KV cache) change on every call: taken from the
        # device copy its own write-back publishes, not restamped as resident state per call.
        written = static & frozenset(position for position, _ in lowered.mutations)
        static = static - written
        # A backward's tangents, on one device: looked up too (another graph's backward may
        # have returned one), and one that is all zeros takes a device array of zeros sent once
        # (autograd materializes the gradient of an output nothing differentiated — an LM's
        # logits beside its loss, batch x length x vocabulary — on every step).
        tangents = frozenset(roles.tangent_inputs) if self._mirror_key else frozenset()
        tangents -= frozenset(position for position, _ in lowered.mutations)  # never donated
        mirrored = (frozenset(roles.mirrored_inputs) | written | tangents) - static - saved
        self._per_call = tuple(e for e in inputs if e[1] not in static | saved | mirrored)
        self._tangent_slots = frozenset(
            slot for slot, position, _ in inputs if position in tangents
        )
        self._zeros: dict[int, Any] = {}  # tangent slot → a device array of zeros
        # Inputs that may be on the device already (a DeviceTensor, a mirror), with the kind a
        # miss is counted as.
        miss = {**dict.fromkeys(written, "parameter"), **dict.fromkeys(saved, "saved")}
        self._looked_up = tuple(
            (*e, sizes[e[0]], miss.get(e[1], "argument"))
            for e in inputs
            if e[1] in saved | mirrored
        )
        self._resident_inputs = tuple(entry for entry in inputs if entry[1] in static)
        self._resident_positions = tuple(position for _, position, _ in self._resident_inputs)
        self._resident_bytes = tuple(sizes[slot] for slot, _, _ in self._resident_inputs)
        # Parameters and buffers stay on the device while their stamp holds (see
        # `_resident_arguments`), in one state replaced whole: threads calling with the
        # parameters of different modules each use the state they made.
        self._resident = _Resident.empty(len(inputs))
        self._output_casts = tuple(
            spec.dtype if spec.dtype != module_dtype else None
            for spec, module_dtype in zip(lowered.output_specs, lowered.module_output_dtypes)
        )
        self._slots = tuple((slot.result, slot.input, slot.value) for slot in lowered.outputs)
        self._views = tuple(  # of a module result, or of an input (`slot.input` set)
            (index, slot.input is not None, *slot.view, slot.view_dtype)
            for index, slot in enumerate(lowered.outputs)
            if slot.view
        )
        # Per-call arguments the graph returns as saved activations (an input the backward
        # reads): their arrays become mirrors, so the backward does not send them again.
        returned = {slot.input for i, slot in enumerate(lowered.outputs) if i in saved_outputs}
        self._mirrored = tuple(e[:2] for e in self._per_call if e[1] in returned and e[2] is None)
        self._bumped = frozenset(roles.bumped_inputs)
        # (module argument, graph input) the executable takes over: buffers it writes in place
        self._donated = tuple(
            (slot + lowered.uses_rng, lowered.tensor_inputs[slot]) for slot in lowered.donated
        )
        self._donated_bytes = sum(sizes[slot] for slot in lowered.donated)
        # Module results that stay on the device: read by saved outputs only, as they are.
        self._defer = defer = roles.defer_host and self._mirror_key is not None
        kinds = module_results.kinds(lowered, saved_outputs, deferred=defer)
        self._kept = tuple(
            r
            for r, kind in enumerate(kinds)
            if kind == "kept" and self._output_casts[r] is None and roles.keep_saved
        )
        # Results returned as host tensors, which another graph may read next (the next graph
        # after a graph break, this one again in a loop, a compiled optimizer step reading a
        # backward's gradients) without sending them again: published as mirrors, a backward's
        # findable by their memory too (autograd hands a gradient on as a `detach()` of it).
        publish = self._mirror_key is not None
        self._by_memory = roles.mirror_outputs
        self._published = tuple(
            r
            for r, kind in enumerate(kinds)
            if publish
            and kind == "output"
            and r not in self._kept
            and self._output_casts[r] is None
        )
        # Per module argument (the seed last), how it is split over a mesh; None: one device.
        self._shardings = mesh_placement.argument_shardings(device, lowered, executable)
        self._run = execution.Runner(executable, device, lowered)
        # Per-call arguments jax's C++ dispatch may take as host arrays (it sends them itself):
        # not one whose array becomes a mirror, nor a donated one.
        self._host_slots = frozenset(
            slot
            for slot, position, _ in self._per_call
            if self._run.dispatch is not None
            and (slot, position) not in self._mirrored
            and slot not in lowered.donated
        )
        self._multiprocess = bool(device.mesh) and distributed.active()
        self._seed_agreed = not self._multiprocess  # one process: nothing to agree with
        self.per_call = collections.Counter()  # what one steady-state call moves
        for slot, _, _ in self._per_call:
            self.per_call[ledger.HOST_TO_DEVICE, "argument"] += sizes[slot]
        if lowered.uses_rng:
            self.per_call[ledger.HOST_TO_DEVICE, "argument"] += 8
        # Whole new values of inputs written in part: the tensors' device copies, never fetched;
        # under host_sync="explicit", every written value and part (fetched only where the
        # tensor is not its whole storage), and a backward's gradients: host tensors left stale.
        written_values = {r for _, r in lowered.mutations}  # (not the parts: never read then)
        stays = [
            r not in written_values or leaves_stale(math.prod(spec.shape))
            for r, spec in enumerate(lowered.output_specs)
        ]
        self._on_device = frozenset(
            r for r, kind in enumerate(kinds) if kind == "device" or kind == "deferred" and stays[r]
        )
        self._deferred = frozenset(
            r for r in self._on_device if kinds[r] == "deferred" and self._output_casts[r] is None
        )
        viewed = {view[2] for view in self._views if not view[1]}
        self._stale_outputs = tuple(
            r
            for r in self._published
            if defer and roles.mirror_outputs and r not in viewed and stays[r]
        )
        # (graph input, module result, its lowering.PartialWrite or None: written whole)
        parts = {write.position: write for write in lowered.partial_writes}
        self._write_backs = tuple((p, r, parts.get(p)) for p, r in lowered.mutations)
        # Results copied to the host: on an accelerator, all their copies are started at once
        # (jax's copy_to_host_async), so they overlap instead of waiting one after another.
        self._unfetched = frozenset((*self._kept, *self._on_device, *self._stale_outputs))
        fetched = [r for r in range(len(kinds)) if r not in self._unfetched]
        self._prefetched = tuple(fetched) if len(fetched) > 1 and not self._transfer.on_cpu else ()
        for r in fetched:
            spec = lowered.output_specs[r]
            kind = {"kept": "saved", "deferred": "mutation"}.get(kinds[r], kinds[r])
            self.per_call[ledger.DEVICE_TO_HOST, kind] += module_results.nbytes(spec, spec.dtype)
        self._calls = ledger.call_count((*self.per_call.items(), (ledger.CALLS, 1)))
        self._crossed = collections.Counter()  # what crossed besides, by (direction, kind)

    @property
    def ledger(self) -> collections.Counter:
        """Every call of this graph: bytes by (direction, kind), and the calls (ledger.CALLS)."""
        calls = collections.Counter({self._calls.entries: self._calls.calls})
        return ledger.summed(calls, self._crossed)

    def output_partition_specs(self) -> dict[int, tuple]:
        """Over a mesh: graph output index → the partition spec (per dim, a mesh axis or None)
        of the outputs that stay on the devices, as the partitioner split them; a layout one
        axis per dim cannot say is left out. Empty on one device."""
        if self._run.result_shardings is None:
            return {}
        kept = {
            index: self._run.result_shardings[slot.result]
            for index, slot in enumerate(self.lowered.outputs)
            if slot.result in self._kept and not slot.view
        }
        return mesh_placement.partition_specs(self.device.axes, kept)

    def transfer_summary(self) -> dict:
        """For compile records: what a steady-state call moves, what the first call moves
        besides (parameters and buffers sent to the device), and what stays there."""
        return {
            "per_call": ledger.as_dict(self.per_call),
            "resident_bytes": sum(self._resident_bytes)
            + sum(e[3] for e in self._looked_up if e[4] == "parameter"),
            "saved_inputs_bytes": sum(e[3] for e in self._looked_up if e[4] == "saved"),
            "kept_on_device": len(self._kept),
            # buffers the executable updates in place (donated): no second copy on the device
            "donated_bytes": self._donated_bytes,
        }

    def __call__(self, args: list) -> list:
        if self._resident_positions:
            arrays = list(self._resident_arguments(args))
        else:
            arrays = list(self._resident.arguments)
        to_device, shardings = self._transfer.to_device, self._shardings
        argument, host_slots = self._transfer.argument, self._host_slots
        for slot, position, cast in self._per_call:
            value = args[position] if cast is None else args[position].to(cast)
            if slot in host_slots:
                arrays[slot] = argument(value)
            else:
                arrays[slot] = to_device(value, shardings[slot])
        if self._looked_up:
            self._looked_up_arguments(args, arrays)
        for slot, position in self._mirrored:
            self._publish(args[position], arrays[slot])
        if self.lowered.uses_rng:
            seed = torch.randint(-(2**31), 2**31 - 1, (2,), dtype=torch.int32)
            if not self._seed_agreed:  # each process sends its own seed to its devices
                distributed.agree("the random seed of a graph's first call", str(seed.tolist()))
                self._seed_agreed = True
            arrays.insert(0, to_device(seed, shardings[-1]))
        if self._multiprocess:
            distributed.execution_started()
        results = self._execute(arrays, args)
        self._calls.calls += 1
        outs = self._outputs(results)
        if self._multiprocess:
            distributed.execution_finished()
        put = residency.mirrors.put_output if self._by_memory else residency.mirrors.put
        for r in self._published:  # (on the CPU, an output reads its array's memory: to_torch)
            put(outs[r], self._mirror_key, results[r])
        for position, result, part in self._write_backs:
            tensor = args[position]
            if result in self._deferred and host_sync.defer(
                tensor, results[result], self._mirror_key, self._transfer.to_torch
            ):
                residency.mirrors.put(tensor, self._mirror_key, results[result])
                continue
            if part is not None and not self._defer:  # the part written: its pieces fetched
                module_results.write_part(tensor, part, outs)
            else:
                tensor.copy_(self._host_value(outs, results, result))
            if self._mirror_key is not None:
                self._mirror_written(tensor, results[result])
        returned = [
            outs[result] if result is not None else value if source is None else args[source]
            for result, source, value in self._slots
        ]
        for index, of_input, base, size, stride, offset, dtype in self._views:
            viewed = args[base] if of_input else outs[base]
            if dtype is not None:  # a result: contiguous, so its flat view is one
                viewed = viewed.reshape(-1).view(dtype)
            returned[index] = viewed.as_strided(size, stride, offset)
        args.clear()
        return returned

    def _host_value(self, outs: list, results: list, r: int) -> torch.Tensor:
        """Module result `r` on the host: fetched already, or now (a value left on the device
        for a tensor that turned out not to be its whole storage: counted)."""
        if outs[r] is None:
            spec = self.lowered.output_specs[r]
            entry = ((ledger.DEVICE_TO_HOST, "mutation"), module_results.nbytes(spec, spec.dtype))
            ledger.add([entry], self._crossed)
            cast = self._output_casts[r]
            outs[r] = self._transfer.to_torch(results[r])
            outs[r] = outs[r] if cast is None else outs[r].to(cast)
        return outs[r]

    def _execute(self, arrays: list, args: list) -> list:
        """Run the executable; one jax array per module result. A donated argument's array is
        deleted by the call: one that is another tensor's (a DeviceTensor's) is copied first;
        if the call fails, the mirrors of the donated tensors are dropped (the host tensors,
        not yet written, are sent again)."""
        if not self._donated:
            return self._run(arrays)
        for slot, position in self._donated:
            if args[position].__class__ is residency.DeviceTensor:
                arrays[slot] = arrays[slot].copy()
        try:
            return self._run(arrays)
        except BaseException:
            for _, position in self._donated:
                residency.mirrors.discard(args[position])
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
        to_torch, specs = self._transfer.to_torch, self.lowered.output_specs
        for r in self._prefetched:
            results[r].copy_to_host_async()
        outs = [
            None if r in self._unfetched else to_torch(x) if cast is None else to_torch(x).to(cast)
            for r, (x, cast) in enumerate(zip(results, self._output_casts))
        ]
        for r in self._kept:
            spec = specs[r]
            outs[r] = residency.DeviceTensor(
                results[r], spec.shape, spec.dtype, to_torch, self._transfer.key
            )
        on_cpu = self._transfer.on_cpu  # (the CPU's zero-copy tensor costs nothing)
        for r in self._stale_outputs:  # gradients under host_sync="explicit"
            spec = specs[r]
            outs[r] = to_torch(results[r]) if on_cpu else torch.empty(spec.shape, dtype=spec.dtype)
            host_sync.defer(outs[r], results[r], self._mirror_key, to_torch, GRADIENT)
        return outs

    def _looked_up_arguments(self, args: list, arrays: list) -> None:
        """The arrays of saved activations, of other graphs' outputs and of tangents: a
        DeviceTensor's own, a mirror's, the zeros kept for a tangent slot (the check reads host
        memory, faster than the link to a TPU), or sent (counted)."""
        key, sent = self._mirror_key, collections.Counter()
        for slot, position, cast, size, kind in self._looked_up:
            value = args[position]
            if (
                value.__class__ is residency.DeviceTensor
                and value.device_key == self._transfer.key
                and cast is None
            ):
                arrays[slot] = self._resharded(value.array, self._shardings[slot])
                continue
            if key is not None and cast is None:
                array = residency.mirrors.get(value, key, position in self._bumped)
                if array is not None:
                    arrays[slot] = array
                    continue
            value = value if cast is None else value.to(cast)
            zero = slot in self._tangent_slots and not host_sync.is_stale(value) and not value.any()
            array = self._zeros.get(slot) if zero else None
            if array is None:
                # (kept zeros are a copy: a zero-copy CPU array would read a tensor written later)
                array = self._transfer.to_device(
                    value.clone() if zero else value, self._shardings[slot]
                )
                sent[ledger.HOST_TO_DEVICE, kind] += size
                if zero:
                    self._zeros[slot] = array
                elif key is not None and cast is None:
                    self._publish(value, array)
            arrays[slot] = array
        if sent:
            ledger.add(sent.items(), self._crossed)

    def _resharded(self, array, sharding):
        """`array` (a saved activation on this mesh) split as this module takes it: moved
        between the devices where the forward's layout differs (no host crossing)."""
        if sharding is None or array.sharding.is_equivalent_to(sharding, array.ndim):
            return array
        import jax

        devices.stats["mesh_reshards"] += 1
        with mesh_placement.exact_dtypes():
            return jax.device_put(array, sharding)

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
        tensors = [args[position] for position in self._resident_positions]
        stamp = residency.stamps(tensors)
        state = self._resident
        if stamp != state.stamp:
            return self._resend(tensors, stamp, state).arguments
        if not state.copies:
            return state.arguments
        arguments = list(state.arguments)  # this call's: the state's copies stay as they are
        for index in state.copies:
            arguments[self._resident_inputs[index][0]] = self._send(index, tensors[index])
        return arguments

    def _resend(self, tensors, stamp: list, state: _Resident) -> _Resident:
        """A new state, published: the changed parameters and the CPU copies sent again."""
        previous = state.stamp or [None] * len(stamp)
        arguments = list(state.arguments)
        copies = []
        for index, (tensor, now, before) in enumerate(zip(tensors, stamp, previous)):
            if now != before or index in state.copies:
                array = self._send(index, tensor)
                arguments[self._resident_inputs[index][0]] = array
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
        slot, position, cast = self._resident_inputs[index]
        key = self._mirror_key if cast is None else None
        bumped = position in self._bumped
        array = None if key is None else residency.mirrors.get(tensor, key, bumped)
        if array is not None:
            return array
        value = tensor if cast is None else tensor.to(cast)
        array = self._transfer.to_device(value, self._shardings[slot])
        ledger.add(
            [((ledger.HOST_TO_DEVICE, "parameter"), self._resident_bytes[index])], self._crossed
        )
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
