"""The on-disk layout of a recording: the one place that names arrays, columns and the schema version.

A run is a Zarr v3 group::

    run.zarr/
      zarr.json             group attributes: {"paperdebugger": {"format", "schema_version", "run": {...}}}
      manifest.json         rank 0's committed lengths and status (plain JSON, written last)
      rank0/                one sub-tree per process (torch.distributed rank)
        zarr.json           group attributes: the rank, world size, backend and its process's run record
        manifest.json       (rank k > 0 only) rank k's commit, written by rank k alone
        steps/<column>      one row per step, in execution order
        tensors/<column>    one row per tensor record; a step's records are contiguous
        payloads/<column>   one row per distinct tensor content (deduplicated by xxh3-128)
        docs/<column>       one row per distinct JSON document (offset, length into docs/bytes)
        docs/bytes          the JSON documents, concatenated (utf-8)
        late/<column>       payloads attached to tensor records after they were written (flight mode)
        dims/values         shapes and strides of tensor records, concatenated (int64)
        blobs/u1 u2 u4 u8   payload bytes, appended; one array per element size so shuffle filters
                            see the real element width

Every array is 1-D or 2-D with a fixed second dimension and grows along axis 0. Arrays may be longer
than their committed length (capacity grows geometrically, and a killed writer may have written
chunks past its last commit): readers slice every array to the length in ``manifest.json``.
See docs/FORMAT.md for the meaning of every column.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import xxhash

FORMAT_NAME = "paperdebugger.run"
SCHEMA_VERSION = "1.31"  # 1.1: late/ (flight mode); 1.2: module skeletons; 1.3: run status "incomplete";
# 1.4: one manifest per rank (rank k > 0 in rank<k>/manifest.json), rank group attributes, role "collective";
# 1.5: a crc32c per index and document chunk, a checksum in every manifest and in our group attributes;
# 1.6: tags $generator and $function, one record per tensor object of a call, skeleton links/parametrizations/hooks;
# 1.7: $dataclass attrs, skeleton tied, grad outputs inside output containers;
# 1.8: steps/flags bits ALERTS, NAN_RESULT, NAN_INPUT; 1.9: tag $partial;
# 1.10: output records "after:<input>" (inputs a call changed in place), input records "<input>:grad" (an input
#       leaf's .grad), skeleton hook kind "prune";
# 1.11: a backward step's parameter grads are its call's own where its extra lists them ("own_grads"), note
#       REUSED_NOTE; 1.12: a collective's "sent" (NaN and Inf this rank sent into it);
# 1.13: tag $mapping (dict subclasses: EasyDict-style configs, OrderedDict)
# 1.14: run.start_iteration (the first iteration's number: a resumed run's), final.iterations counted from it
# 1.15: a step's RNG document holds parts "global:<name>": generator objects its code reads as module-level globals
# 1.16: documents keep their keys in the recorded object's order (a module's children and parameters, a dict
#       argument's items; sorted before); the run's final attributes and manifest info list "module_objects":
#       the places (step name, module path) several module objects ran as one step at, with their instances;
#       a tensor record's shape may hold RAGGED_DIM (a torch.nested tensor's ragged dimension; statistics only);
#       later, without a change of schema: a definition document's "globals" (what module-level names its code
#       reads were bound to: classes and functions other than that name's own definition; older readers ignore it)
# 1.17: a module step's RNG document holds parts "module:<path>": generator objects its module and submodules hold
#       as attributes, at each call (the skeleton's torch.Generator state is the one it was built with); and
#       the skeleton of a step's module holds "submodule_code": the file, line and source SHA-256 of each class of
#       its submodules that is the training code's own, by class reference (older readers ignore it); and
#       a $ndarray laid out other than C-contiguous (a transposed or reversed view) holds its "strides"; and
#       a step's extra "subclasses": the tensor subclass (class reference, instance attributes) of its records
#       that held one; a replay makes the arguments' again (before, it gave the step plain tensors)
# 1.18: a skeleton's "made": attributes holding modules that are only their class (or a dict of them: Llama's
#       attention's _kernel_funcs), which a replay makes again by calling the class (before, "unrecorded"); and a
#       definition document's "wrapper": the function is a decorator's wrapper without functools.wraps;
#       and a step's extra "sparse": the layout and the number of stored values of each record that was a sparse
#       tensor (its statistics are of those values; the note on it says the number too), by which a replay
#       compares a sparse result and a count of NaN/Inf is of its stored values (before: a crash, the dense size);
#       and $object for an object whose bases hold no state but have an empty __slots__ or are typing.Generic
#       (torch.distributions' Independent) and for torch.distributions' transforms (before, $opaque); and the
#       setting "distributions_validate_args" (torch.distributions' default validate_args);
#       and grad inputs of tensors inside the arguments' tuples, lists, dicts, named tuples (PackedSequence:
#       "args.0.data") and dataclasses, and UNFOLLOWED_NOTE on input records too; a step's extra
#       "saved_tensors_hooks": the saved-tensor hooks its call ran under, which a replay applies again;
#       and $function names module-level functions of the training code too (a BlockMask's mask_mod; before,
#       $opaque), and an $opaque function's repr is its qualified name "<function module:QualName>"
# 1.19: role "component": the tensors a sparse input, output, parameter or buffer is made of (COO indices and
#       values as it held them, coalesced or not; CSR/BSR crow and col indices and values; CSC/BSC ccol and row
#       indices and values), records of their own named "<record>:<part>" with their bytes where the step kept
#       payloads, named in the step's extra "sparse" ("parts", and "coalesced" for COO): a replay makes the sparse
#       tensor again and compares a sparse result bit for bit (before, statistics of its stored values only: a step
#       given one was refused);
#       and a top-level leaf argument that requires grad (a parameter given to an update step) is not tapped: the
#       step gets the caller's tensor (before, a tapped alias without its .grad); its grad input is the sum of its
#       uses in the call's graph, and none is recorded for a module's own parameter given as an argument (its
#       gradient is in the parameter's; a replay passes the parameter itself there, before 1.19 through a tap);
#       note LEAF_UNFOLLOWED_NOTE; a step's extra "aliases" may name "<input>:grad" records (an argument's .grad
#       given as an argument too, or sharing memory with one)
# 1.20: output records "after:<parameter>": a module step's own parameters its call changed in place (version
#       counter), as it left them (a frozen router bias or base weight written under no_grad); before, not recorded
# 1.21: an argument a step uses several times (attn(h, h, h)) passes each use's gradient on to the caller's tensor
#       apart, as autograd adds them unrecorded (before, their sum: the caller's gradients, and all upstream of
#       them, differed in the last bits); a step's records are as before, but the grad inputs and parameter grads
#       of an outer step whose inner step so used its argument hold the bits autograd's additions give that way
# 1.22: a step's RNG document holds parts "default:<parameter>": the numpy and Python generator objects its
#       parameters default to, where the call took the default; and a tensor a call takes as a parameter's
#       default is recorded as if passed through a decorator's functools.wraps and for an annotated instance
#       too (before, a paper step's own signature only); and up to 16 uses of each argument
#       pass on apart (1.21: 4; more were summed, in the last bits as before 1.21)
# 1.23: tag $rng: a numpy Generator, RandomState or bit generator or a random.Random passed as an argument, its
#       state at the call as a "global:" RNG part's document, which a replay makes a new generator of (before,
#       $opaque, and the step's replay was refused); a reader of 1.22 refuses such a step as holding an unknown tag;
#       and grad inputs of the leaves inside a step's container arguments (a functional forward's weights in a dict:
#       "args.1.w1"), the sums of their uses in the call's graph, as a top-level leaf's (before, none)
# 1.24: component records of a backward step's sparse gradients (grad_output, grad_input, param_grad: the weight grad
#       of nn.Embedding(sparse=True)) where the step kept payloads, named in its extra "sparse" as 1.19's are, by
#       which a backward replay compares them bit for bit (before, statistics of their stored values only: not
#       compared, and a backward step with no other gradient refused)
# 1.25: a step's extra "misaligned": the bytes past a multiple of ALIGNMENT at which each of its inputs, parameters,
#       buffers and grad outputs that did not begin at one lay (a view xs[t] of a time-major batch), by which a
#       replay gives it memory at that address modulo ALIGNMENT again (CPU kernels pick their code by alignment, and
#       round otherwise: before, such a step replayed as a mismatch)
# 1.26: a module a modules= glob selects is recorded after its own forward pre-hooks ran (its arguments, state and
#       RNG states as its forward got them, as a decorated class's), where a call says nothing else: a note
#       UNRUN_PRE_HOOKS_NOTE names the pre-hooks that ran after it; a replay runs it without them as it runs a
#       decorated class's (before, before them: a replay warned of them, and one that changed the arguments
#       made every replay of the module differ)
# 1.27: a module skeleton's "computed": the plain tensor attributes that were computed with autograd when it was
#       built (set on the module by code outside it for the call: AWD-LSTM's WeightDrop), by which a replay of the
#       module's own step names the enclosing step to replay instead (before, it advised register_buffer)
# 1.28: no record changed; a backward pass through a use of a tapped tensor that its step's end did not find (an
#       argument used after the step returned, a result returned inside a plain object) adds that tensor's uses'
#       gradients in the order they run (recorder.taps.order_uses), so an outer step's gradients hold other bits
# 1.29: a dict's int key whose text is also one of its string keys is named [1] in record names (output.[1]);
#       both were output.1 before; a module skeleton's other_hooks name a backward pre-hook "backward pre-hook
#       NAME" (before, "backward hook NAME", as a full backward hook: bisect could not tell the one that ran on a
#       step's grad outputs before they were recorded)
# 1.30: tag $module: an nn.Module given to a step as an argument (a soft update's target network, inside a list, a
#       method's self.net) is its skeleton and its parameters and buffers as input records "<path>.<name>"
#       (with "after:" records where the call changed them in place, and ":grad" records of their .grad), which a
#       replay rebuilds (before, $opaque: the step's replay was refused); a reader of 1.29 refuses such a step as
#       holding an unknown tag
# 1.31: role network_grad: the gradients a backward step's call sent the parameters of the networks its forward
#       was given ($module), the sums of their uses in the call's graph as a leaf argument's grad input, named by
#       the parameters' input records (before, none: such a backward step could not be replayed); a reader of
#       1.30 refuses such a step as holding a role it does not know. Also a step's extra "dtensors": the records
#       that held a DTensor hold this rank's local shard, with its placements, device mesh, mesh coordinate and
#       whole shape (before, the bytes at the DTensor's null data pointer: garbage); a wrapper subclass of another
#       kind is a record of metadata with a note; a reader of 1.30 replays such a step with the local shards and
#       may differ, with a warning naming the DTensor class
NETWORK_GRADS_SINCE = (1, 31)
CHECKED_SINCE = (1, 5)  # recordings of this schema or later must carry every checksum
# Arrays that recordings of an older schema may lack, and the schema from which every recording has them:
# late/ came with 1.1; steps/flags during 1.2 (the first 1.2 recordings have none, and their flags are computed
# from the tensor statistics: replayer.bisect.step_flags).
REQUIRED_SINCE: dict[str, tuple[int, int]] = {"late/tensor": (1, 1), "late/payload": (1, 1), "steps/flags": (1, 3)}
KINDS_SINCE = (1, 8)  # recordings of this schema or later tell NaN from Inf in steps/flags
REQUIRES_GRAD_SINCE = (1, 2)  # recordings of this schema or later keep a tensor's requires_grad (before: false)
# Recordings of this schema or later count steps/call as the recorder does now (per name, paper label and
# code, in the iteration); 1.2 to 1.9 counted per name, 1.0 and 1.1 per name and module path.
CALLS_SINCE = (1, 10)
MAPPINGS_SINCE = (1, 13)  # recordings of this schema or later keep dict subclasses as $mapping
STRIDES_SINCE = (1, 17)  # recordings of this schema or later keep a numpy array's layout ($ndarray "strides")
RAGGED_SINCE = (1, 16)  # recordings of this schema or later may hold RAGGED_DIM in a shape (elsewhere: damage)
SUBMODULE_CODE_SINCE = (1, 17)  # recordings of this schema or later hold the code hashes of submodule classes
SPARSE_PARTS_SINCE = (1, 19)  # recordings of this schema or later keep a sparse tensor's parts where they keep payloads
SPARSE_GRAD_PARTS_SINCE = (1, 24)  # ... a sparse gradient's too (before: its statistics only)
LEAVES_UNTAPPED_SINCE = (1, 19)  # recordings of this schema or later tapped no top-level leaf argument
USES_APART_SINCE = (1, 21)  # recordings of this schema or later pass an argument's uses in a step on apart
MORE_SPARES_SINCE = (1, 22)  # ... up to 16 uses of each (before: 4; the rest summed)
NESTED_LEAVES_SINCE = (1, 23)  # ... and follow the leaves inside container arguments for their gradients
ORDERED_USES_SINCE = (1, 28)  # ... and add the uses of a tapped tensor their steps' ends did not find in order
BACKWARD_PRE_HOOKS_SINCE = (1, 29)  # recordings of this schema or later name a module's backward pre-hooks apart
HOOKED_INPUTS_SINCE = (1, 26)  # recordings of this schema or later record a modules= glob's module after its own
# forward pre-hooks ran (unless a note says otherwise: UNRUN_PRE_HOOKS_NOTE); before, before them
CHECKSUM_KEY = "checksum"
SCHEMA_MAJOR = 1
ATTRS_KEY = "paperdebugger"
MANIFEST_KEY = "manifest.json"

NO_REF = -1  # a missing reference in an integer column (no parent, no payload, no document)
# The step note (in its ``extra`` document) on payloads the store could not keep up with, as the
# reader recognises it: "<n> payload(s) not recorded: the store could not keep up (...)".
DROPPED_NOTE = "payload(s) not recorded: the store could not keep up"
# A record's note for a tensor without strided bytes (sparse, meta): "<name>: <layout> tensor on <device>: " + this;
# for a torch.nested tensor, "<name>: nested tensor (<layout> layout) of <n> tensors of sizes ... on <device>: " + this;
# for a tensor the recorder failed to read, "<name>: <type> that could not be captured (<error>): " + this.
METADATA_NOTE = "metadata only"
# The end of a sparse record's note: "<name>: <layout> tensor on <device>: metadata only; statistics of its <n>
# stored values " + this (before 1.18 without <n>: "statistics of its stored values " + this).
STORED_NOTE = "(the zeros it does not store left out)"
# A component record's name: a sparse record's name + this + the part's name ("args.0:indices", "output:values";
# torch's names: indices, values; crow_indices, col_indices; ccol_indices, row_indices). Since 1.19.
PART_SEPARATOR = ":"
# The address alignment a step's extra "misaligned" is about (bytes): the allocators' (CPU: 64, CUDA: a multiple of it).
ALIGNMENT = 64
# A step's note: this + ": <error>": capturing the call failed (its arguments or outputs are missing or partial,
# and recording stopped there); a replay refuses it.
CAPTURE_FAILED_NOTE = "capture failed"
# A dimension without one size in a record's shape (a nested tensor's ragged dimension), in a record without
# payload. Since 1.16.
RAGGED_DIM = -1
# A record's note for a lazy module's parameter or buffer before its first call gave it a shape:
# "<name>: " + this. The record has shape () and no statistics.
UNINITIALIZED_NOTE = ("uninitialized (a lazy module's, before the call that gives it its shape; a replay leaves it "
                      "uninitialized, and the call initializes it again with the recorded RNG)")
# A forward step's note: "<buffer names>: " + this. Recordings made before it lack it.
BUFFERS_WRITTEN_NOTE = ("written or replaced since the module's last recorded call, by code outside its calls "
                        "(load_state_dict, .to(), a reset, a call not recorded): the call found them as that code "
                        "left them, not as its last call did")
# A forward step's note: "<output or input record names> " + this (no tap followed them: see recorder.taps;
# input records since 1.18)
# A forward step's note: "<parameter names>: " + this.
RETURNED_PARAM_NOTE = ("returned as they are by the step (leaves, not followed for gradients): the gradient the "
                       "caller's use of them sends is in their parameter grads too, which a replay of this step's "
                       "backward does not compute")
# A forward step's output record named this + an input's record name: that input as the call left it
# (changed in place: an EMA update, a parameter update under no_grad). Since 1.10.
AFTER_PREFIX = "after:"
# A forward step's input record named an input leaf's record name + this: that leaf's .grad when the
# call began (a parameter given to an update step), which a replay sets on it again. Since 1.10.
GRAD_SUFFIX = ":grad"
# The bytes of a CPU input up to which the recorder keeps its bits through the call, to see a write through .data
# (``p.data.add_(...)``, which leaves the version counter as it was): a larger one's, or one not on the CPU, changed
# so, has no AFTER_PREFIX record.
KEPT_INPUT_BYTES = 1 << 20


def data_writes_seen(device: str, nbytes: int) -> bool:
    """Whether the recorder sees a write through ``.data`` to an input of a step (``device`` as a record names it,
    ``nbytes`` its size): by the bits it keeps of a CPU input up to ``KEPT_INPUT_BYTES``."""
    return device == "cpu" and nbytes <= KEPT_INPUT_BYTES


# A forward step's note: "<parameter>[, <parameter>...]: " + this + " (<its other paths>)".
SHARED_PARAM_NOTE = ("shared with modules outside the step (tied weights): their use of them adds to the parameter "
                     "grads, which a replay of this step's backward does not compute")
# A step's note: "<hooks>: " + this. Since 1.11.
GLOBAL_HOOK_NOTE = ("hooks on every module's calls (torch.nn.modules.module.register_module_forward_hook and the "
                    "like) were registered in the process when this step ran; a replay runs without them")
# A backward step's note: the pass raised (anomaly mode's "returned nan values" in an inner step's backward, a
# Ctrl-C) before this step's grad inputs and own parameter grads had all come.
STOPPED_PASS_NOTE = "the backward pass stopped before this step finished"
# A backward step's note: its parameter grads that are totals (not in its "own_grads") came through
# nodes that another call made or used too. Since 1.11.
REUSED_NOTE = ("its parameter grads came through nodes that more than one call used (a weight made once for "
               "several calls, parametrize.cached()): each is a total over those calls, which a replay of "
               "this step's backward does not compute")
# A forward step's note: "<parametrized tensors of its module>: " + this (their paths in the module: "sn.weight").
# Came without a schema change (2026-12-07).
CACHED_PARAMETRIZATION_NOTE = ("taken from the cache of torch.nn.utils.parametrize.cached(), made there by an earlier "
                               "call: a replay makes them anew from their parametrizations (a spectral norm's power "
                               "iteration runs again, from the vectors that call left)")
# A forward step's note: "<parameter>: " + this + " (<hooks>)".
PARAM_HOOK_NOTE = ("the parameter had gradient hooks of its own (Tensor.register_hook): its recorded gradient is what "
                   "they made of it, and a replay runs without them")
# A backward step's note: a pass through gradients an earlier pass took with create_graph=True.
SECOND_ORDER_NOTE = ("an earlier backward pass took this call's gradients with create_graph=True (a gradient "
                     "penalty): this pass's gradients hold second-order terms, through that graph of gradients")
UNFOLLOWED_NOTE = ("not followed for gradients (taps reach tensors in tuples, lists, dicts, named tuples and "
                   "dataclasses only): a replay of the backward leaves out the gradients that came through them")
# A forward step's note: "<output record names> " + this, for outputs that share memory (a step returning x and a
# view of it), which UNFOLLOWED_NOTE named before 2026-12-07 with a reason that was not theirs.
SHARED_OUTPUTS_NOTE = ("share memory with each other (a tensor and a view of it): not followed for gradients, so that "
                       "an in-place change to one after the step reaches the other's gradient as it does unrecorded; "
                       "a replay of the backward leaves out the gradients that came through them")
# A forward step's note: "<input record names> " + this. Since 1.19.
LEAF_UNFOLLOWED_NOTE = ("leaves given as arguments (the step gets them as they are, untapped), whose uses in the "
                        "call's graph could not be found (a graph of more than 100000 nodes, or made on several "
                        "threads): their gradients are not recorded")
# A forward step's note: "<input record names>: " + this; its extra's "aliases" says where each lies in which storage.
SHARED_ARGUMENTS_NOTE = ("share memory with each other (views of one tensor): not followed for gradients, so that an "
                         "in-place change to one reaches the others' gradients as without recording; a replay gives "
                         "them one storage again")
# A step's note: "<record names>: " + this. Since 2026-12-06, without a schema change (before, recording stopped at
# the first such call).
# A replay runs the step on the primal values and compares its primal results.
DUAL_NOTE = ("forward-AD dual tensors (torch.autograd.forward_ad): their primal values are recorded, not their "
             "tangents, and they are not followed for gradients (the gradient a JVP term sends through a tangent "
             "does not pass the step's outputs)")
# A forward step's note: "<input record names>: " + this. Since 2026-12-06, without a schema change (before,
# the caller's tensor kept its history from before the change, and its later uses' gradients missed the change).
CHANGED_ARGUMENT_NOTE = ("changed in place by the step, which did not return them: the gradient the caller's later "
                         "uses of them send passes through the step's in-place operations, so their grad inputs "
                         "are not recorded, and a parameter grad of the step may hold that gradient too, which a "
                         "replay of its backward does not compute")
# A forward step's note: "<output record names>: " + this (an object holding them could not be copied)
UNCOPIED_NOTE = ("in an object that could not be copied to follow them (a copy failed, or kept them in another place): "
                 "their grad outputs are not recorded")

# A forward step's note: "<keyword argument names>: " + this (a module a modules= glob selected, called
# before its own keyword pre-hook was registered, or from compiled code: recorder.autohooks).
LATE_KWARGS_NOTE = ("keyword arguments captured when the call ended (its module's first call, or one from compiled "
                    "code): one the call changed in place is recorded as the call left it, and none is followed for "
                    "gradients")

# A forward step's note: "<hook names>: " + this (a module a modules= glob selected, whose capture began before
# these forward pre-hooks of its own ran: recorder.autohooks). Since 1.26, which records such a module's calls
# after its own forward pre-hooks (before, every call was recorded before them: HOOKED_INPUTS_SINCE).
UNRUN_PRE_HOOKS_NOTE = ("forward pre-hooks of its module that ran after its arguments, state and RNG states were "
                        "recorded (its first call as the outermost module, one from compiled code, or hooks "
                        "registered while recording): a replay runs without them")


@dataclass(frozen=True)
class Column:
    """One appendable array: its path under the rank group, dtype, row shape and rows per chunk."""

    path: str
    dtype: str
    row_shape: tuple[int, ...] = ()
    chunk_rows: int = 8192  # small enough that rewriting the tail at every commit is cheap
    kind: str = "index"  # "index" (small columns), "blob" (payload bytes) or "docs" (JSON bytes)


# Step table. Integer references to documents point into the docs table.
STEP_COLUMNS: dict[str, str] = {
    "name": "int64",  # doc: the step's name (str)
    "definition": "int64",  # doc: paper reference, kind, import reference, file, source and its hash
    "phase": "int8",  # 0 forward, 1 backward
    "iteration": "int64",
    "call": "int32",  # forward calls of the same step name before this one in this iteration, from 0
    "parent": "int64",  # enclosing step's index, or -1
    "forward": "int64",  # for a backward step: its forward step's index; -1 for forward steps
    "module_path": "int64",  # doc: str, relative to the outermost module called ("" for that module)
    "module": "int64",  # doc: class reference and constructor arguments of the step's module, or -1
    "status": "int8",  # see STATUSES
    "flags": "int8",  # NONFINITE_RESULT | NONFINITE_INPUT (schema 1.2) | ALERTS | NAN_* (1.8), from the statistics
    "t_start": "float64",  # seconds since the run's start (run attribute "started_unix")
    "t_end": "float64",
    "rng": "int64",  # doc: RNG snapshot at step entry
    "settings": "int64",  # doc: numerics settings snapshot at step entry
    "args": "int64",  # doc: {"args": [...], "kwargs": {...}} tagged JSON, tensors by record name; -1
    "output": "int64",  # doc: the output structure, tensors by record name; -1
    "extra": "int64",  # doc: exception, alerts, watch expectations; -1 when there is nothing
    "tensor_start": "int64",  # first row of this step's tensor records
    "tensor_count": "int32",
}

TENSOR_COLUMNS: dict[str, tuple[str, tuple[int, ...]]] = {
    "step": ("int64", ()),
    "role": ("int8", ()),  # see ROLES
    "name": ("int64", ()),  # doc: str
    "dtype": ("int64", ()),  # doc: str, torch's name without "torch." ("bfloat16")
    "device": ("int64", ()),  # doc: str ("cpu", "cuda:0")
    "requires_grad": ("bool", ()),
    "ndim": ("int16", ()),
    "dims_start": ("int64", ()),  # shape then stride: dims/values[dims_start : dims_start + 2 * ndim]
    "stats": ("float64", (8,)),  # see STAT_NAMES
    "payload": ("int64", ()),  # row of the payloads table, or -1 when only statistics were kept
}

PAYLOAD_COLUMNS: dict[str, tuple[str, tuple[int, ...]]] = {
    "hash": ("uint64", (2,)),  # xxh3-128 of the bytes, (high, low)
    "blob": ("int8", ()),  # index into BLOB_UNITS
    "offset": ("int64", ()),  # element offset in blobs/<unit>
    "count": ("int64", ()),  # elements of the unit
}

# Payloads attached to tensor records after the records were written (flight mode writes a step's
# statistics at once and its bytes only if they are kept): tensors/payload stays -1 for these rows.
LATE_COLUMNS: dict[str, tuple[str, tuple[int, ...]]] = {
    "tensor": ("int64", ()),  # row of the tensors table
    "payload": ("int64", ()),  # row of the payloads table
}

DOC_COLUMNS: dict[str, tuple[str, tuple[int, ...]]] = {
    "offset": ("int64", ()),  # byte offset in docs/bytes
    "length": ("int64", ()),
}

# Payload bytes are stored in the array whose element width matches the tensor's (complex numbers by
# their component), so byte- and bit-shuffle filters group the right bytes together.
BLOB_UNITS: tuple[str, ...] = ("u1", "u2", "u4", "u8")
BLOB_DTYPES: dict[str, str] = {"u1": "uint8", "u2": "uint16", "u4": "uint32", "u8": "uint64"}
BLOB_CHUNK_BYTES = 4 << 20

DOCS_CHUNK_BYTES = 1 << 20
DIMS_CHUNK = 65536

ROLES: tuple[str, ...] = (
    "input", "output", "param", "buffer", "grad_output", "grad_input", "param_grad", "watch",
    "collective",  # schema 1.4: what a torch.distributed collective inside the step returned
    "component",  # schema 1.19: a part of a sparse record's tensor (its indices, its values): "<record>:<part>"
    # schema 1.31: what a backward step's call sent a parameter of a network it was given ($module), named by
    # that parameter's input record ("args.1.0.weight")
    "network_grad",
)
GRAD_ROLES = ("grad_input", "param_grad", "network_grad")  # a backward step's results, by role name
UNKNOWN_ROLE = "unknown role"  # a role a newer minor schema added: "unknown role 9"


def role_name(index: int) -> str:
    """A tensor record's role by its value: one of ROLES, or ``UNKNOWN_ROLE`` and the value for one that a
    newer minor schema added (the reader refuses such values in a recording of this schema or older)."""
    return ROLES[index] if 0 <= index < len(ROLES) else f"{UNKNOWN_ROLE} {index}"


def role_value(name: str) -> int:
    """The value of a role ``role_name`` gave (a copy keeps a role a newer minor schema added)."""
    return ROLES.index(name) if name in ROLES else int(name.removeprefix(UNKNOWN_ROLE))


PHASES: tuple[str, ...] = ("forward", "backward")
# A step's results by phase (role indices): NaN or Inf in one of these makes the step ``nonfinite``;
# in its inputs, parameters or grad outputs it came from somewhere else.
RESULT_ROLES: dict[int, frozenset[int]] = {0: frozenset({ROLES.index("output")}),
                                           1: frozenset({ROLES.index(r) for r in GRAD_ROLES})}
# A step's own inputs by phase: NaN or Inf here came from outside it (a backward step also uses its
# forward step's inputs and parameters: see that step's flags).
# A collective's result came from the other ranks: an input too.
INPUT_ROLES: dict[int, frozenset[int]] = {0: frozenset({ROLES.index("input"), ROLES.index("param"),
                                                         ROLES.index("buffer"), ROLES.index("collective")}),
                                          1: frozenset({ROLES.index("grad_output"), ROLES.index("collective")})}
NONFINITE_RESULT = 1  # steps/flags bits
NONFINITE_INPUT = 2
ALERTS = 4  # 1.8: the step's extra holds alerts, whatever its status (a nonfinite step's broken watch)
NAN_RESULT = 8  # 1.8: NaN (not only Inf) among the NONFINITE_RESULT tensors; Inf alone is often meant (masks)
NAN_INPUT = 16  # 1.8: NaN among the NONFINITE_INPUT tensors
STATUSES: tuple[str, ...] = ("ok", "alert", "nonfinite", "exception")
STAT_NAMES: tuple[str, ...] = ("min", "max", "mean", "std", "absmax", "norm", "nan", "inf")
# incomplete: the recorder stopped before the run ended (its writer failed: a full disk, a store gone;
# or capture failed) while training went on; crashed: the run ended by an exception, or its process died.
RUN_STATUSES: tuple[str, ...] = ("recording", "complete", "crashed", "incomplete")


def columns() -> list[Column]:
    """Every array of a rank group, in the order a writer creates them."""
    cols = [Column(f"steps/{n}", d) for n, d in STEP_COLUMNS.items()]
    cols += [Column(f"tensors/{n}", d, s) for n, (d, s) in TENSOR_COLUMNS.items()]
    cols += [Column(f"payloads/{n}", d, s) for n, (d, s) in PAYLOAD_COLUMNS.items()]
    cols += [Column(f"docs/{n}", d, s) for n, (d, s) in DOC_COLUMNS.items()]
    cols += [Column(f"late/{n}", d, s) for n, (d, s) in LATE_COLUMNS.items()]
    cols.append(Column("docs/bytes", "uint8", (), DOCS_CHUNK_BYTES, kind="docs"))
    cols.append(Column("dims/values", "int64", (), DIMS_CHUNK))
    for unit in BLOB_UNITS:
        itemsize = int(unit[1:])
        cols.append(Column(f"blobs/{unit}", BLOB_DTYPES[unit], (), BLOB_CHUNK_BYTES // itemsize, kind="blob"))
    return cols


def rank_group(rank: int) -> str:
    return f"rank{rank}"


def manifest_key(rank: int) -> str:
    """Where a rank commits: rank 0 in the root ``manifest.json`` (the only manifest before schema
    1.4, so older readers still read rank 0), every other rank in its own group's ``manifest.json``:
    ranks never write the same file."""
    return MANIFEST_KEY if rank == 0 else f"{rank_group(rank)}/{MANIFEST_KEY}"


def checksum(doc: dict[str, Any]) -> str:
    """The checksum of a metadata document (a manifest, our group attributes): xxh3-64 of its
    canonical JSON (sorted keys, no spaces) without the checksum itself. Raises ValueError for a
    document that is not plain JSON (a NaN token)."""
    body = {k: v for k, v in doc.items() if k != CHECKSUM_KEY}
    return xxhash.xxh3_64_hexdigest(json.dumps(body, separators=(",", ":"), sort_keys=True, allow_nan=False).encode())


def parse_version(text: str) -> tuple[int, int]:
    """Parse "MAJOR.MINOR"; raises ValueError on anything else."""
    major, minor = text.split(".")
    return int(major), int(minor)
